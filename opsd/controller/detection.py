"""The controller's detection pass and its incidents: failures of running runs (``opsd.policy.detection``) opened as
incidents and handed to the recovery executor, recovered incidents closed once the relaunch progresses, runs
waiting for a spare taken up again once one is there. Straggler scoring and cadence planning
(``opsd.controller.scoring``) run in the same pass when it is called alone (``tick``), on a thread of their own
beside the passes when they run on their schedule (``tick_every``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from opsd.controller.barren import give_up_at_start
from opsd.controller.dry_run import record_dry_run
from opsd.controller.incidents import (
    failure_key,
    failure_of,
    generation_of,
    is_failure,
    took_step,
    unfinished_incident,
)
from opsd.controller.live import RankLive
from opsd.controller.rows import RunRow
from opsd.controller.schedule import Schedule
from opsd.policy.detection import CollectiveTimeout, Failure, FailureKind, Findings, detect
from opsd.policy.replicas import Scope, failed_group, recovery_scope
from opsd.protocol.records import IncidentRow
from opsd.protocol.states import ActionKind, IncidentState, NodeRole, RunState
from opsd.protocol.xid_table import XidAction

log = logging.getLogger(__name__)

XID_CLOCK_SLACK_S = 60.0  # an XID's failure time is its event time, but no earlier than this before detection


class Detection(Schedule):
    def tick(self, now_s: float, *, score: bool = True) -> list[Failure]:
        """Detect failures of running runs and start their recovery; score stragglers and plan cadences (unless
        ``score`` is false: ``score`` does, on a thread of its own)."""
        found: list[Failure] = []
        with self.ticking:
            for run in self.store.runs():
                self._record(run, now_s)
                if run.state == RunState.WAITING_FOR_SPARE:
                    self._retry_waiting(run, now_s)
                if run.state == RunState.RUNNING and run.groups:
                    self.recall_groups(run, now_s)
                    if any(launch.out for launch in run.groups.values()):
                        self._retry_out_groups(run, now_s)
                if run.state.finished and not self.settled(run.id):
                    self._settle(run, now_s)
                if run.state.finished:
                    self._reported_late(run, now_s)
                if run.state != RunState.RUNNING:
                    continue
                self.adopt_cadence(run)  # this controller's first pass: the cadence its predecessor published
                if self.backend is not None:
                    self._resume_held(run, now_s)
                self._progress(run, now_s)
                findings = self._detect(run.id, now_s, run.spec.replicas.fault_tolerant)
                self._agents_down(run, findings.agents_down, now_s)
                failures = findings.failures
                if failures:
                    found.extend(failures)
                    self.open_failure(run, failures, now_s)
                    continue
                if score:
                    with self.scoring:
                        self._score(run.id, now_s)
                        self._plan(run, now_s)
            self.forget_settled(now_s)
        return found

    def _record(self, run: RunRow, now_s: float) -> None:
        """Write the record of a running run's launch now and then, and a finished run's once more at its end."""
        run_id, state = run.id, RunState(run.state)
        due = self.launch_record_due(run_id, now_s) if state == RunState.RUNNING else False
        ended = state.finished and self.last_recorded_s(run_id) < float(run.updated_s)
        if due or ended:
            self.record_launch(run_id, int(run.generation), now_s)

    def _detect(self, run: str, now_s: float, fault_tolerant: bool = False) -> Findings:
        active = self.store.node_names(run, NodeRole.ACTIVE)
        groups = self.rank_groups(run) if fault_tolerant else None
        with self.lock:
            self.drain()  # the heartbeats the API's event loop left for later: a node in them was heard from
            live = self.live_of(run)
            names = active | live.rank_nodes.keys() if live is not None else active
        # the scan of every node goes without the lock, which the API's thread waits for (12,288 nodes: up to 60 ms
        # beside it): only a node silent past the floor, or with GPU events, can have failed. A node's last sign of
        # life is a number replaced whole; one heard from since it was read is only less silent, and is looked at
        # again below, with the lock
        heard_s = now_s - self.config.detection.heartbeat_floor_s  # a node last heard from before then is suspect
        suspects = [
            n for n in map(self.nodes.get, names) if n is not None and (n.events or n.last_heartbeat_s < heard_s)
        ]
        ready = self.backend_node_ready([n.node for n in suspects if n.last_heartbeat_s < heard_s])
        with self.lock:
            nodes = [n for n in suspects if self.nodes.get(n.node) is n]  # still known
            events = [e for n in nodes for e in n.events.values()]
            if (live is None or not live.ranks) and not events:
                return Findings([], [])
            ranks: Iterable[RankLive] = ()
            timeouts = []
            if live is not None:
                # every rank only when one may have failed: it exited, waits on a collective, or no rank stepped
                # within the hang floor (a hang is never detected sooner), or a node is silent (its ranks' peers
                # witness whether they are alive); else none of them can be a failure
                quiet = now_s - live.latest_progress_s <= self.config.detection.hang_floor_s
                silent = any(n.last_heartbeat_s < heard_s for n in nodes)
                if live.exited or live.waiting or not quiet or silent:
                    ranks = live.ranks.values()
                for rank in sorted(live.waiting):
                    r = live.ranks[rank]
                    timeouts.append(CollectiveTimeout(rank, r.node, r.timeout))
            return detect(
                now_s=now_s,
                nodes=nodes,
                ranks=ranks,
                events=events,
                timeouts=timeouts,
                step_times_s=live.step_times_s if live is not None else (),
                config=self.config.detection,
                rank_groups=groups,
                report_interval_s=self.telemetry.interval_s,
                node_ready=ready,
                recovering=list((m.failed_groups or {}) if (m := self.memory.get(run)) else ()),  # groups out
            )

    def open_failure(self, run: RunRow, failures: list[Failure], now_s: float) -> int:
        """One incident per launch: the first failure (a swap first) is the cause; the rest are its consequences.
        In a fault-tolerant run, a failure confined to a replica group is that group's incident, one per launch of
        the group, and the other groups train on (``opsd.policy.replicas``). The incident is recorded (once: the
        same failure seen again finds it) and, with a backend, recovered from; in dry run, its plan is recorded and
        nothing is done; returns its id."""
        cause = failures[0]
        failed_s = self._failed_at(run.id, cause, now_s)
        scope = self._scope(run, cause)
        key = failure_key(run.id, run.generation)
        launch = None
        if scope.group is not None:
            launch = self._group_launch(run, scope.group, cause)
            key = failure_key(run.id, launch, scope.group)
        incident, new = self.store.open_incident(
            key=key,
            run=run.id,
            kind=cause.kind.value,
            node=cause.node,
            rank=cause.rank,
            detail=cause.detail,
            failed_s=failed_s,
            detected_s=now_s,
            replica_group=scope.group,
        )
        if new:
            self._trace_ids(incident, cause)
            others = "; ".join(f"{f.kind.value} on {f.node}" for f in failures[1:]) or "none"
            log.warning(
                "run %s: incident %d: %s on %s (rank %s): %s; also seen: %s",
                run.id,
                incident,
                cause.kind.value,
                cause.node,
                cause.rank,
                cause.detail,
                others,
            )
            if run.spec.replicas.fault_tolerant:
                log.warning("run %s: incident %d: %s", run.id, incident, scope.why)
        self._handled_events(cause, now_s)
        if self.config.dry_run:
            if new:
                record_dry_run(self.store, run, incident, cause, now_s)
            return incident
        if self.backend is not None:
            if self.held(run.id, incident, new):  # recovered from once the window ends
                return incident
            if new and scope.group is None and give_up_at_start(self.store, run.id, self.config.barren_launches, now_s):
                return incident
            if scope.group is None:
                self.store.update_run(run.id, now_s, state=RunState.RECOVERING)
            else:  # its peers stop waiting on it at once (Policy.failed_groups), until it is back
                with self.lock:
                    memory = self.remember(run.id)
                    if launch is not None and memory.group_launches.get(scope.group, launch) <= launch:
                        memory.group_failed(scope.group, incident)
            self.recovery.start(run.id, incident, cause, now_s)
        return incident

    def _group_launch(self, run: RunRow, group: int, cause: Failure) -> int:
        """The launch of replica group ``group`` that ``cause`` happened in: the one its ranks there report (a
        cluster may have relaunched the group on its own since opsd launched it), else the one opsd launched."""
        with self.lock:
            live = self.live_of(run.id)
            mine = [r for r in live.ranks.values() if r.group == group and r.launch is not None] if live else []
        there = [r for r in mine if r.rank == cause.rank or r.node == cause.node] or mine
        return max((int(r.launch) for r in there if r.launch is not None), default=run.groups[group].launch)

    def _scope(self, run: RunRow, cause: Failure) -> Scope:
        """What the recovery from ``cause`` stops: one replica group of a fault-tolerant run, or the whole job."""
        layout = run.spec.replicas
        if not layout.fault_tolerant or not run.groups:
            return recovery_scope(cause, layout, None, ())
        node_groups = {node: g for g, launch in run.groups.items() for node in launch.nodes}
        group = failed_group(cause, self.rank_groups(run.id), node_groups)
        with self.lock:
            memory = self.memory.get(run.id)
            down = set(memory.groups_down) if memory is not None else set()
        live = [g for g in run.active_groups() if g not in down or g == group]
        return recovery_scope(cause, layout, group, live)

    def _progress(self, run: RunRow, now_s: float) -> None:
        """Keep the run's newest step, and close the incidents a relaunch has recovered from."""
        with self.lock:
            live = self.live_of(run.id)
            newest = live.newest_step if live is not None else -1
        if newest < 0:
            return
        if run.first_productive_s is None:
            self._first_productive(run, now_s)
        self._close_recovered(run, now_s)
        if newest > int(run.last_step):
            self.store.update_run(run.id, now_s, last_step=newest)
            with self.lock:
                self.remember(run.id).progressed_s = now_s

    def _settle(self, run: RunRow, now_s: float) -> None:
        """A finished run: the incidents its last launch recovered from are closed, though the run may have ended
        before a pass saw that launch progress (it ran to its end while a controller that took over waited for the
        cluster, or between two passes). A run that failed or was stopped recovered from nothing. Once nothing is
        left to close, the run is settled (not looked at again)."""
        if run.state == RunState.COMPLETED:
            current = int(run.generation)
            unfinished = [i for i in self._open(run) if is_failure(i) and i.replica_group is None]
            if any(generation_of(i.key) >= current for i in unfinished):
                return  # its recovery has not relaunched yet (a leader that took over goes on with it)
            self._close_recovered(run, now_s, ended=True)
        self.settle(run.id, now_s)

    def _reported_late(self, run: RunRow, now_s: float) -> None:
        """A finished run's final step raised to what its last launch reported after the end was seen: the ranks'
        last reports reach the controller with their agent's next heartbeat, which may come after the backend said
        the run completed (on a cluster, a JobSet's Completed condition)."""
        if run.final_step is None:
            return
        with self.lock:
            live = self.live_of(run.id)
            newest = live.newest_step if live is not None else -1
        if newest > int(run.final_step):
            log.info("run %s: its final step is %d (reported after its end), not %d", run.id, newest, run.final_step)
            self.store.update_run(run.id, float(run.updated_s), final_step=newest)  # its end stays when it ended

    def _open(self, run: RunRow) -> list[IncidentRow]:
        return self.store.incidents(run.id, state=IncidentState.OPEN)

    def _close_recovered(self, run: RunRow, now_s: float, *, ended: bool = False) -> None:
        """Close the incidents of earlier launches: the first progress of the new launch is the first productive
        step (lost steps: from the checkpoint resumed from to the newest step before the failure). ``ended``: the
        run finished, and an incident of an earlier launch is closed even when nothing of the last launch was
        heard (then when and where it resumed are not known). A replica recovery's incident closes when its group
        is back (``_close_group``)."""
        opened = self._open(run)
        for incident in opened:
            if incident.replica_group is not None:
                self._close_group(run, incident, now_s, ended=ended)
        earlier = [i for i in opened if i.replica_group is None and generation_of(i.key) < run.generation]
        if not earlier:
            return
        with self.lock:
            live = self.live_of(run.id)
            ranks = [r for r in live.ranks.values() if r.step >= 0] if live is not None else []
            first = min((r.step for r in ranks), default=-1)
            said = [r.resumed_from_step for r in ranks if r.resumed_from_step is not None]
            resumed_s = min((r.progress_s for r in ranks), default=now_s)
        if first < 0 and not ended:
            return
        # the backend knows (it chose the checkpoint), else the ranks say, else their first step tells
        resumed_from = self.backend.resumed_from(run.id) if self.backend is not None else None
        if resumed_from is None and first >= 0:
            resumed_from = min(said) if said else max(0, first - 1)
        lost: int | None = None
        if resumed_from is not None:
            # the steps the failed launch had made past the checkpoint (not the run's best: an earlier launch may
            # have got further and lost more, which its own incident counted)
            before = self.ended_step(run.id)
            lost = max(0, (before if before >= 0 else int(run.last_step)) - resumed_from)
        if first < 0:
            resumed_s = float(run.updated_s)  # no later than the run's end
        for incident in earlier:
            self.store.update_incident(
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
                self.tracing.trace(self.store, int(incident.id))

    def _close_group(self, run: RunRow, incident: IncidentRow, now_s: float, *, ended: bool) -> None:
        """A replica recovery is over when its group's new launch made its first step in the quorum (it healed from
        a live group): then, the steps the other groups made while it was out (``missed_steps``), the longest they
        waited for a quorum meanwhile (``stall_s``: their stall around the failure), the steps they discarded
        meanwhile (``lost_steps``: their update thrown away, their batch done again; the most of any of their ranks)
        and where it healed to. ``ended``: the run finished without it."""
        group = incident.replica_group
        assert group is not None
        with self.lock:
            memory = self.memory.get(run.id)
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
        self.store.update_incident(
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
            self.tracing.trace(self.store, incident.id)

    def _first_productive(self, run: RunRow, now_s: float) -> None:
        """The run's first progress ends its launch and initialisation (the ``startup`` badput): when its ranks
        first stepped, as the first progress after a relaunch ends a recovery."""
        with self.lock:
            live = self.live_of(run.id)
            ranks = [r for r in live.ranks.values() if r.step >= 0] if live is not None else []
            first_s = min((r.progress_s for r in ranks), default=now_s)
        first_s = max(first_s, float(run.created_s))
        self.store.update_run(run.id, now_s, first_productive_s=first_s)
        log.info("run %s: first productive step %.1f s after its start", run.id, first_s - float(run.created_s))

    def _failed_at(self, run: str, cause: Failure, now_s: float) -> float:
        """When the failure happened, as well as the controller can tell: the last sign of life."""
        with self.lock:
            if cause.kind is FailureKind.HEARTBEAT_LOSS and cause.node in self.nodes:
                return self.nodes[cause.node].last_heartbeat_s
            if cause.kind in (FailureKind.FATAL_XID, FailureKind.APPLICATION_XID) and cause.node in self.nodes:
                seen = [e.time_s for e in self.nodes[cause.node].events.values() if e.time_s is not None]
                # the agent's time of the event, within reason (a node's clock may be off; an old event resent)
                return max(min(min(seen, default=now_s), now_s), now_s - XID_CLOCK_SLACK_S)
            if cause.kind is FailureKind.HANG:
                live = self.live_of(run)
                return max((r.progress_s for r in live.ranks.values()), default=now_s) if live else now_s
            return now_s

    def _trace_ids(self, incident: int, cause: Failure) -> None:
        """A new incident's trace id (when traces are exported), and the agent's span of the GPU event that caused
        it (when it sent one: the trace links to it)."""
        ids: dict[str, str] = {}
        if cause.kind in (FailureKind.FATAL_XID, FailureKind.APPLICATION_XID):
            with self.lock:
                live = self.nodes.get(cause.node)
                traced = [live.events[seq] for seq in sorted(live.events)] if live is not None else []
            action = XidAction.CORDON_AND_SWAP if cause.kind is FailureKind.FATAL_XID else XidAction.RESTART_JOB
            first = next((e for e in traced if e.action == action and e.trace_id and e.span_id), None)
            if first is not None:
                ids.update(gpu_trace_id=first.trace_id, gpu_span_id=first.span_id)
        self.tracing.assign(self.store, incident, **ids)

    def _handled_events(self, cause: Failure, now_s: float) -> None:
        if cause.kind not in (FailureKind.FATAL_XID, FailureKind.APPLICATION_XID):
            return
        with self.lock:
            live = self.nodes.get(cause.node)
            if live is None or not live.events:
                return
            newest = max(live.events)
        self.store.ack_events(cause.node, newest, now_s)  # first: a heartbeat now does not add them again
        with self.lock:
            for seq in [seq for seq in live.events if seq <= newest]:
                del live.events[seq]

    def _retry_out_groups(self, run: RunRow, now_s: float) -> None:
        """Replica groups wait out of the quorum for a node: once a spare is there, their recoveries go on (the
        group is relaunched and heals); the run trained on without them meanwhile."""
        if self.backend is None or self.choose_spare(run.id, "") is None:
            return
        for incident in self._open(run):
            if incident.replica_group is None or not is_failure(incident):
                continue
            if took_step(self.store, incident.id, ActionKind.LAUNCH):
                continue
            log.info(
                "run %s: a spare is available; replica group %d's recovery goes on", run.id, incident.replica_group
            )
            self.recovery.start(run.id, incident.id, failure_of(incident), now_s)
            return  # one at a time: the next pass takes the next group up

    def _retry_waiting(self, run: RunRow, now_s: float) -> None:
        """A run waits for a spare: once one is there (a node uncordoned or added), go on with its recovery."""
        if self.backend is None or self.choose_spare(run.id, "") is None:
            return
        incident = unfinished_incident(self.store, run.id)
        if incident is None:
            return
        log.info("run %s: a spare is available; incident %d's recovery goes on", run.id, incident.id)
        self.store.update_run(run.id, now_s, state=RunState.RECOVERING)
        self.recovery.start(run.id, int(incident.id), failure_of(incident), now_s)
