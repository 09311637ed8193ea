"""What a run's progress says, at each detection pass: its newest step kept, the incidents a relaunch recovered from
closed (with the time it took, the steps lost, the stall), its first productive step, a finished run settled once
nothing is left to close, and a final step its ranks reported after the end."""

from __future__ import annotations

import logging

from opsd.controller.core import ControllerCore
from opsd.controller.incidents import generation_of, is_failure
from opsd.controller.rows import RunRow
from opsd.protocol.records import IncidentRow
from opsd.protocol.states import IncidentState, RunState

log = logging.getLogger(__name__)


class Progress:
    def __init__(self, core: ControllerCore) -> None:
        self.core = core

    def track(self, run: RunRow, now_s: float) -> None:
        """Keep the run's newest step, and close the incidents a relaunch has recovered from."""
        with self.core.lock:
            live = self.core.live_of(run.id)
            newest = live.newest_step if live is not None else -1
        if newest < 0:
            return
        if run.first_productive_s is None:
            self._first_productive(run, now_s)
        self._close_recovered(run, now_s)
        if newest > int(run.last_step):
            self.core.store.update_run(run.id, now_s, last_step=newest)
            with self.core.lock:
                self.core.remember(run.id).progressed_s = now_s

    def settle(self, run: RunRow, now_s: float) -> None:
        """A finished run: the incidents its last launch recovered from are closed, though the run may have ended
        before a pass saw that launch progress (it ran to its end while a controller that took over waited for the
        cluster, or between two passes). A run that failed or was stopped recovered from nothing. Once nothing is
        left to close, the run is settled (not looked at again)."""
        if run.state == RunState.COMPLETED:
            current = int(run.generation)
            unfinished = [i for i in self.open_incidents(run) if is_failure(i) and i.replica_group is None]
            if any(generation_of(i.key) >= current for i in unfinished):
                return  # its recovery has not relaunched yet (a leader that took over goes on with it)
            self._close_recovered(run, now_s, ended=True)
        self.core.settle(run.id, now_s)

    def reported_late(self, run: RunRow, now_s: float) -> None:
        """A finished run's final step raised to what its last launch reported after the end was seen: the ranks'
        last reports reach the controller with their agent's next heartbeat, which may come after the backend said
        the run completed (on a cluster, a JobSet's Completed condition)."""
        if run.final_step is None:
            return
        with self.core.lock:
            live = self.core.live_of(run.id)
            newest = live.newest_step if live is not None else -1
        if newest > int(run.final_step):
            log.info("run %s: its final step is %d (reported after its end), not %d", run.id, newest, run.final_step)
            self.core.store.update_run(run.id, float(run.updated_s), final_step=newest)  # its end stays when it ended

    def open_incidents(self, run: RunRow) -> list[IncidentRow]:
        """The run's incidents still open."""
        return self.core.store.incidents(run.id, state=IncidentState.OPEN)

    def _close_recovered(self, run: RunRow, now_s: float, *, ended: bool = False) -> None:
        """Close the incidents of earlier launches: the first progress of the new launch is the first productive
        step (lost steps: from the checkpoint resumed from to the newest step before the failure). ``ended``: the
        run finished, and an incident of an earlier launch is closed even when nothing of the last launch was
        heard (then when and where it resumed are not known). A replica recovery's incident closes when its group
        is back (``_close_group``)."""
        opened = self.open_incidents(run)
        for incident in opened:
            if incident.replica_group is not None:
                self._close_group(run, incident, now_s, ended=ended)
        earlier = [i for i in opened if i.replica_group is None and generation_of(i.key) < run.generation]
        if not earlier:
            return
        with self.core.lock:
            live = self.core.live_of(run.id)
            ranks = [r for r in live.ranks.values() if r.step >= 0] if live is not None else []
            first = min((r.step for r in ranks), default=-1)
            said = [r.resumed_from_step for r in ranks if r.resumed_from_step is not None]
            resumed_s = min((r.progress_s for r in ranks), default=now_s)
        if first < 0 and not ended:
            return
        # the backend knows (it chose the checkpoint), else the ranks say, else their first step tells
        resumed_from = self.core.backend.resumed_from(run.id) if self.core.backend is not None else None
        if resumed_from is None and first >= 0:
            resumed_from = min(said) if said else max(0, first - 1)
        lost: int | None = None
        if resumed_from is not None:
            # the steps the failed launch had made past the checkpoint (not the run's best: an earlier launch may
            # have got further and lost more, which its own incident counted)
            before = self.core.ended_step(run.id)
            lost = max(0, (before if before >= 0 else int(run.last_step)) - resumed_from)
        if first < 0:
            resumed_s = float(run.updated_s)  # no later than the run's end
        for incident in earlier:
            self.core.store.update_incident(
                incident.id,
                state=IncidentState.RECOVERED,
                resumed_s=resumed_s,
                resumed_from_step=resumed_from,
                lost_steps=lost,
            )
            log.info(
                "run %s: incident %d recovered: resumed from step %s, %s steps lost, %.1f s after detection%s",
                run.id,
                incident.id,
                resumed_from,
                lost,
                resumed_s - incident.detected_s,
                "" if first >= 0 else " (the run ended before its last launch was heard from)",
            )
            if is_failure(incident):  # a straggler warning of the old launch is closed, not traced
                self.core.tracing.trace(self.core.store, int(incident.id))

    def _close_group(self, run: RunRow, incident: IncidentRow, now_s: float, *, ended: bool) -> None:
        """A replica recovery is over when its group's new launch made its first step in the quorum (it healed from
        a live group): then, the steps the other groups made while it was out (``missed_steps``), the longest they
        waited for a quorum meanwhile (``stall_s``: their stall around the failure), the steps they discarded
        meanwhile (``lost_steps``: their update thrown away, their batch done again; the most of any of their ranks)
        and where it healed to. ``ended``: the run finished without it."""
        group = incident.replica_group
        assert group is not None
        with self.core.lock:
            memory = self.core.memory.get(run.id)
            if memory is None:
                return
            launch = memory.group_launches.get(group, memory.launch)
            relaunched = launch is not None and launch > generation_of(incident.key)
            live = memory.live
            members = [r for r in live.ranks.values() if r.group == group and r.step >= 0] if live else []
            others = [r for r in live.ranks.values() if r.group != group] if live else []
            down = memory.groups_down.get(group)
            if not (relaunched and members) and not ended:
                return
            memory.groups_down.pop(group, None)
            memory.groups_back([group])
        healed_to = min((r.step for r in members), default=None)
        missed = (
            healed_to - down.ended_step if down is not None and healed_to is not None and down.ended_step >= 0 else None
        )
        stall = None
        if down is not None and others:
            stall = max(
                0.0, *(r.quorum_wait_total_s - down.waited_s.get(r.rank, r.quorum_wait_total_s) for r in others)
            )
        lost = 0
        if down is not None and others:
            lost = max(0, *(r.discarded_total - down.discarded.get(r.rank, r.discarded_total) for r in others))
        resumed_s = min((r.progress_s for r in members), default=float(run.updated_s))
        self.core.store.update_incident(
            incident.id,
            state=IncidentState.RECOVERED,
            resumed_s=resumed_s,
            resumed_from_step=healed_to,
            lost_steps=lost,
            missed_steps=missed,
            stall_s=stall,
        )
        log.info(
            "run %s: incident %d recovered: replica group %d back at step %s after %.1f s (%s steps missed; the"
            " others waited %s s more for a quorum and discarded %d steps)",
            run.id,
            incident.id,
            group,
            healed_to,
            resumed_s - incident.detected_s,
            missed,
            None if stall is None else round(stall, 2),
            lost,
        )
        if is_failure(incident):
            self.core.tracing.trace(self.core.store, incident.id)

    def _first_productive(self, run: RunRow, now_s: float) -> None:
        """The run's first progress ends its launch and initialisation (the ``startup`` badput): when its ranks
        first stepped, as the first progress after a relaunch ends a recovery."""
        with self.core.lock:
            live = self.core.live_of(run.id)
            ranks = [r for r in live.ranks.values() if r.step >= 0] if live is not None else []
            first_s = min((r.progress_s for r in ranks), default=now_s)
        first_s = max(first_s, float(run.created_s))
        self.core.store.update_run(run.id, now_s, first_productive_s=first_s)
        log.info("run %s: first productive step %.1f s after its start", run.id, first_s - float(run.created_s))
