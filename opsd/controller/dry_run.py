"""A controller in dry run (``controller.dry_run``, ``opsd serve --dry-run``): it detects and decides as it would,
records every incident and the recovery steps it would take, and takes none. The incident is marked ``dry_run``
and its steps ``not_taken``: no controller carries them out later (a takeover looks for ``open`` incidents and
``pending`` steps only), the backend is never called, and the run goes on as it is. A way to try opsd on a cluster
first: the incidents, ``opsd incidents`` and the post-mortem say what it would have done, and when.
"""

from __future__ import annotations

import logging

from opsd.controller.rows import RunRow
from opsd.controller.state import StateStore
from opsd.policy.detection import Failure
from opsd.policy.recovery import plan_recovery, request_id
from opsd.protocol.states import ActionState, IncidentState
from opsd.protocol.steps import step_args

log = logging.getLogger(__name__)


def record_dry_run(store: StateStore, run: RunRow, incident_id: int, failure: Failure, now_s: float) -> list[str]:
    """Record the plan of incident ``incident_id`` as steps not taken and mark it ``dry_run``; the steps' kinds."""
    incident = store.incident(incident_id)
    steps = plan_recovery(
        failure,
        incident_id=incident_id,
        generation=run.generation,
        checkpoint_at_step=None,
        group=incident.replica_group if incident is not None else None,
    )
    for seq, step in enumerate(steps):
        store.record_action(
            request_id(incident_id, seq, step.kind),
            run=run.id,
            incident_id=incident_id,
            seq=seq,
            kind=step.kind,
            args=step_args(step),
            now_s=now_s,
            state=ActionState.NOT_TAKEN,
        )
    store.update_incident(incident_id, state=IncidentState.DRY_RUN)
    planned = [str(step.kind) for step in steps]
    log.warning("run %s: incident %d: dry run: would %s; nothing done", run.id, incident_id, ", ".join(planned))
    return planned
