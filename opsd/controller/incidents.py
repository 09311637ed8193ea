"""Incident keys and rows: how an incident is named in the state store, and the failure a row records.

An incident's ``key`` is unique: the same failure reported again (an agent resends an unacknowledged XID, a
second detection pass sees it too) finds the incident it opened. A failure incident is one per launch
(``run/genN``: the first failure of a launch is the cause, the rest its consequences); a straggler warning one per
rank and launch (``run/genN/straggler/R``).
"""

from __future__ import annotations

from opsd.controller.state import StateStore
from opsd.policy.detection import Failure
from opsd.protocol.records import IncidentRow
from opsd.protocol.states import FAILURE_KINDS, WARNING_KINDS, ActionKind, ActionState, IncidentKind, IncidentState

#: incident kinds that are no failure of the machines (the MTBF estimate leaves them out)
NOT_FAILURES = frozenset({*WARNING_KINDS, IncidentKind.MANUAL_RESTART})


def failure_key(run: str, generation: int, group: int | None = None) -> str:
    """A failure's incident key: one per launch of the run, or, for a replica recovery, of its group (``group``:
    the group, ``generation`` its launch)."""
    return f"{run}/gen{generation}" if group is None else f"{run}/gen{generation}/group{group}"


def straggler_key(run: str, generation: int, rank: int) -> str:
    return f"{run}/gen{generation}/straggler/{rank}"


def agent_down_key(run: str, generation: int, node: str, last_heard_s: float) -> str:
    """One warning per silence of a node's agent (its last sign of life names it) and launch."""
    return f"{run}/gen{generation}/agent_down/{node}/{last_heard_s:.3f}"


def generation_of(key: str) -> int:
    """The launch an incident key (``run/genN[/...]``) belongs to (-1: none)."""
    for part in key.split("/"):
        if part.startswith("gen") and part[3:].isdigit():
            return int(part[3:])
    return -1


def failure_of(incident: IncidentRow) -> Failure:
    """The failure an incident row records (to go on with its recovery)."""
    return Failure(incident.kind, incident.node, incident.rank, incident.detail)


def is_failure(incident: IncidentRow) -> bool:
    """Whether an incident records a failure (a straggler, an agent down are warnings)."""
    return incident.kind in FAILURE_KINDS


def unfinished_incident(store: StateStore, run: str) -> IncidentRow | None:
    """The open failure incident of ``run`` whose recovery has not relaunched the ranks yet, if any."""
    for incident in reversed(store.incidents(run, state=IncidentState.OPEN)):
        if is_failure(incident) and not took_step(store, incident.id, ActionKind.LAUNCH):
            return incident
    return None


def took_step(store: StateStore, incident_id: int, kind: ActionKind, *, begun: bool = False) -> bool:
    """Whether the recovery of the incident has done a step of ``kind`` (``begun``: or recorded it, about to)."""
    actions = store.actions(incident_id=incident_id)
    return any(a.kind == kind and (begun or a.state == ActionState.DONE) for a in actions)
