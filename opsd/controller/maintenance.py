"""The controller's side of maintenance windows (``opsd.controller.holds``): an incident of a run held is recorded
and not recovered from (``Detection.open_failure``), and recovered from once the window ends (``_resume_held``).
"""

from __future__ import annotations

import logging

from opsd.controller.incidents import failure_of, unfinished_incident
from opsd.controller.needs import MaintenanceNeeds
from opsd.controller.rows import RunRow
from opsd.protocol.states import RunState

log = logging.getLogger(__name__)


class Maintenance:
    def __init__(self, core: MaintenanceNeeds) -> None:
        self.core = core

    def held(self, run: str, incident: int, new: bool) -> bool:
        """Whether a maintenance window holds the recovery of ``run`` from ``incident`` (said once, when ``new``)."""
        hold = self.core.holds.of(run)
        if hold is not None and new:
            log.warning("run %s: incident %d held for maintenance (%s)", run, incident, hold.reason)
        return hold is not None

    def _resume_held(self, run: RunRow, now_s: float) -> None:
        """A run no maintenance window holds any more, with a failure incident recorded and not recovered from (a
        running run has none otherwise): its recovery starts."""
        incident = unfinished_incident(self.core.store, run.id)
        if incident is None or incident.replica_group is not None or self.core.holds.of(run.id) is not None:
            return
        log.warning("run %s: incident %d no longer held: its recovery starts", run.id, incident.id)
        self.core.store.update_run(run.id, now_s, state=RunState.RECOVERING)
        self.core.recovery.start(run.id, int(incident.id), failure_of(incident), now_s)
