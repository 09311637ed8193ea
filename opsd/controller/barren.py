"""A job that fails at start is failed, not relaunched for ever (``opsd.policy.recovery.fails_at_start``): when a
failure opens an incident while earlier failures of the run are still open, none of their relaunches having made a
step, and ``controller.barren_launches`` of them are, the run is failed and its open incidents abandoned, saying why."""

from __future__ import annotations

import logging

from opsd.controller.incidents import NOT_FAILURES
from opsd.controller.state import StateStore
from opsd.policy.recovery import fails_at_start
from opsd.protocol.states import FAILURE_KINDS, IncidentKind, IncidentState, RunState

log = logging.getLogger(__name__)

#: the failures of the job or its machines: an operator's restart and a controller's are neither
JOB_FAILURES = FAILURE_KINDS - NOT_FAILURES - {IncidentKind.CONTROLLER_RESTART}


def give_up_at_start(store: StateStore, run: str, barren_launches: int, now_s: float) -> bool:
    """Whether ``run``'s job fails at start (its open failures, the one just opened among them, are as many as
    ``barren_launches``); if so, the run is failed and those incidents abandoned."""
    unresumed = [
        i
        for i in store.incidents(run)
        if i.kind in JOB_FAILURES and i.replica_group is None and i.state == IncidentState.OPEN and i.resumed_s is None
    ]
    if not fails_at_start(len(unresumed), barren_launches):
        return False
    why = (
        f"the job failed {len(unresumed)} times in a row and no relaunch made a step: it fails at start, and is"
        " not launched again (fix it, then start the run again)"
    )
    for incident in unresumed:
        store.update_incident(
            int(incident.id), state=IncidentState.ABANDONED, detail=f"{incident.detail}; {why}"[:4000]
        )
    store.update_run(run, now_s, state=RunState.FAILED)
    log.error("run %s: %s", run, why)
    return True
