"""The controller's detection pass and its incidents: failures of running runs (``opsd.policy.detection``) opened as
incidents and handed to the recovery executor, runs waiting for a spare taken up again once one is there. The
incidents recovered from are closed by ``opsd.controller.progress`` once the relaunch progresses. Straggler scoring
and cadence planning (``opsd.controller.scoring``) run in the same pass when it is called alone (``tick``), on a
thread of their own beside the passes when they run on their schedule (``opsd.controller.schedule``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from opsd.controller.barren import give_up_at_start
from opsd.controller.core import ControllerCore
from opsd.controller.dry_run import record_dry_run
from opsd.controller.incidents import (
    failure_key,
    failure_of,
    is_failure,
    took_step,
    unfinished_incident,
)
from opsd.controller.live import RankLive
from opsd.controller.maintenance import Maintenance
from opsd.controller.progress import Progress
from opsd.controller.rows import RunRow
from opsd.controller.scoring import Scoring
from opsd.controller.silence import Silence
from opsd.controller.spares import choose_spare
from opsd.policy.detection import CollectiveTimeout, Failure, FailureKind, Findings, detect
from opsd.policy.replicas import Scope, failed_group, recovery_scope
from opsd.protocol.states import ActionKind, NodeRole, RunState
from opsd.protocol.xid_table import XidAction

log = logging.getLogger(__name__)

XID_CLOCK_SLACK_S = 60.0  # an XID's failure time is its event time, but no earlier than this before detection


class Detection:
    def __init__(
        self, core: ControllerCore, scoring: Scoring, silence: Silence, maintenance: Maintenance, progress: Progress
    ) -> None:
        self.core = core
        self.progress = progress
        self.scoring = scoring
        self.silence = silence
        self.maintenance = maintenance

    def tick(self, now_s: float, *, score: bool = True) -> list[Failure]:
        """Detect failures of running runs and start their recovery; score stragglers and plan cadences (unless
        ``score`` is false: ``score`` does, on a thread of its own)."""
        found: list[Failure] = []
        with self.core.ticking:
            for run in self.core.store.runs():
                self._record(run, now_s)
                if run.state == RunState.WAITING_FOR_SPARE:
                    self._retry_waiting(run, now_s)
                if run.state == RunState.RUNNING and run.groups:
                    self.core.recall_groups(run, now_s)
                    if any(launch.out for launch in run.groups.values()):
                        self._retry_out_groups(run, now_s)
                if run.state.finished and not self.core.settled(run.id):
                    self.progress.settle(run, now_s)
                if run.state.finished:
                    self.progress.reported_late(run, now_s)
                if run.state != RunState.RUNNING:
                    continue
                self.scoring.adopt_cadence(run)  # this controller's first pass: the cadence its predecessor published
                if self.core.backend is not None:
                    self.maintenance._resume_held(run, now_s)
                self.progress.track(run, now_s)
                findings = self._detect(run.id, now_s, run.spec.replicas.fault_tolerant)
                self.silence._agents_down(run, findings.agents_down, now_s)
                failures = findings.failures
                if failures:
                    found.extend(failures)
                    self.open_failure(run, failures, now_s)
                    continue
                if score:
                    with self.core.scoring_lock:
                        self.scoring._score(run.id, now_s)
                        self.scoring._plan(run, now_s)
            self.core.forget_settled(now_s)
        return found

    def _record(self, run: RunRow, now_s: float) -> None:
        """Write the record of a running run's launch now and then, and a finished run's once more at its end."""
        run_id, state = run.id, RunState(run.state)
        due = self.core.launch_record_due(run_id, now_s) if state == RunState.RUNNING else False
        ended = state.finished and self.core.last_recorded_s(run_id) < float(run.updated_s)
        if due or ended:
            self.core.record_launch(run_id, int(run.generation), now_s)

    def _detect(self, run: str, now_s: float, fault_tolerant: bool = False) -> Findings:
        active = self.core.store.node_names(run, NodeRole.ACTIVE)
        groups = self.core.rank_groups(run) if fault_tolerant else None
        with self.core.lock:
            self.core.drain()  # the heartbeats the API's event loop left for later: a node in them was heard from
            live = self.core.live_of(run)
            names = active | live.rank_nodes.keys() if live is not None else active
        # the scan of every node goes without the lock, which the API's thread waits for (12,288 nodes: up to 60 ms
        # beside it): only a node silent past the floor, or with GPU events, can have failed. A node's last sign of
        # life is a number replaced whole; one heard from since it was read is only less silent, and is looked at
        # again below, with the lock
        heard_s = now_s - self.core.config.detection.heartbeat_floor_s  # a node last heard from before then is suspect
        suspects = [
            n for n in map(self.core.nodes.get, names) if n is not None and (n.events or n.last_heartbeat_s < heard_s)
        ]
        ready = self.silence.backend_node_ready([n.node for n in suspects if n.last_heartbeat_s < heard_s])
        with self.core.lock:
            nodes = [n for n in suspects if self.core.nodes.get(n.node) is n]  # still known
            events = [e for n in nodes for e in n.events.values()]
            if (live is None or not live.ranks) and not events:
                return Findings([], [])
            ranks: Iterable[RankLive] = ()
            timeouts = []
            if live is not None:
                # every rank only when one may have failed: it exited, waits on a collective, or no rank stepped
                # within the hang floor (a hang is never detected sooner), or a node is silent (its ranks' peers
                # witness whether they are alive); else none of them can be a failure
                quiet = now_s - live.latest_progress_s <= self.core.config.detection.hang_floor_s
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
                config=self.core.config.detection,
                rank_groups=groups,
                report_interval_s=self.core.telemetry.interval_s,
                node_ready=ready,
                recovering=list((m.failed_groups or {}) if (m := self.core.memory.get(run)) else ()),  # groups out
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
        incident, new = self.core.store.open_incident(
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
        if self.core.config.dry_run:
            if new:
                record_dry_run(self.core.store, run, incident, cause, now_s)
            return incident
        if self.core.backend is not None:
            if self.maintenance.held(run.id, incident, new):  # recovered from once the window ends
                return incident
            if (
                new
                and scope.group is None
                and give_up_at_start(self.core.store, run.id, self.core.config.barren_launches, now_s)
            ):
                return incident
            if scope.group is None:
                self.core.store.update_run(run.id, now_s, state=RunState.RECOVERING)
            else:  # its peers stop waiting on it at once (Policy.failed_groups), until it is back
                with self.core.lock:
                    memory = self.core.remember(run.id)
                    if launch is not None and memory.group_launches.get(scope.group, launch) <= launch:
                        memory.group_failed(scope.group, incident)
            self.core.recovery.start(run.id, incident, cause, now_s)
        return incident

    def _group_launch(self, run: RunRow, group: int, cause: Failure) -> int:
        """The launch of replica group ``group`` that ``cause`` happened in: the one its ranks there report (a
        cluster may have relaunched the group on its own since opsd launched it), else the one opsd launched."""
        with self.core.lock:
            live = self.core.live_of(run.id)
            mine = [r for r in live.ranks.values() if r.group == group and r.launch is not None] if live else []
        there = [r for r in mine if r.rank == cause.rank or r.node == cause.node] or mine
        return max((int(r.launch) for r in there if r.launch is not None), default=run.groups[group].launch)

    def _scope(self, run: RunRow, cause: Failure) -> Scope:
        """What the recovery from ``cause`` stops: one replica group of a fault-tolerant run, or the whole job."""
        layout = run.spec.replicas
        if not layout.fault_tolerant or not run.groups:
            return recovery_scope(cause, layout, None, ())
        node_groups = {node: g for g, launch in run.groups.items() for node in launch.nodes}
        group = failed_group(cause, self.core.rank_groups(run.id), node_groups)
        with self.core.lock:
            memory = self.core.memory.get(run.id)
            down = set(memory.groups_down) if memory is not None else set()
        live = [g for g in run.active_groups() if g not in down or g == group]
        return recovery_scope(cause, layout, group, live)

    def _failed_at(self, run: str, cause: Failure, now_s: float) -> float:
        """When the failure happened, as well as the controller can tell: the last sign of life."""
        with self.core.lock:
            if cause.kind is FailureKind.HEARTBEAT_LOSS and cause.node in self.core.nodes:
                return self.core.nodes[cause.node].last_heartbeat_s
            if cause.kind in (FailureKind.FATAL_XID, FailureKind.APPLICATION_XID) and cause.node in self.core.nodes:
                seen = [e.time_s for e in self.core.nodes[cause.node].events.values() if e.time_s is not None]
                # the agent's time of the event, within reason (a node's clock may be off; an old event resent)
                return max(min(min(seen, default=now_s), now_s), now_s - XID_CLOCK_SLACK_S)
            if cause.kind is FailureKind.HANG:
                live = self.core.live_of(run)
                return max((r.progress_s for r in live.ranks.values()), default=now_s) if live else now_s
            return now_s

    def _trace_ids(self, incident: int, cause: Failure) -> None:
        """A new incident's trace id (when traces are exported), and the agent's span of the GPU event that caused
        it (when it sent one: the trace links to it)."""
        ids: dict[str, str] = {}
        if cause.kind in (FailureKind.FATAL_XID, FailureKind.APPLICATION_XID):
            with self.core.lock:
                live = self.core.nodes.get(cause.node)
                traced = [live.events[seq] for seq in sorted(live.events)] if live is not None else []
            action = XidAction.CORDON_AND_SWAP if cause.kind is FailureKind.FATAL_XID else XidAction.RESTART_JOB
            first = next((e for e in traced if e.action == action and e.trace_id and e.span_id), None)
            if first is not None:
                ids.update(gpu_trace_id=first.trace_id, gpu_span_id=first.span_id)
        self.core.tracing.assign(self.core.store, incident, **ids)

    def _handled_events(self, cause: Failure, now_s: float) -> None:
        if cause.kind not in (FailureKind.FATAL_XID, FailureKind.APPLICATION_XID):
            return
        with self.core.lock:
            live = self.core.nodes.get(cause.node)
            if live is None or not live.events:
                return
            newest = max(live.events)
        self.core.store.ack_events(cause.node, newest, now_s)  # first: a heartbeat now does not add them again
        with self.core.lock:
            for seq in [seq for seq in live.events if seq <= newest]:
                del live.events[seq]

    def _retry_out_groups(self, run: RunRow, now_s: float) -> None:
        """Replica groups wait out of the quorum for a node: once a spare is there, their recoveries go on (the
        group is relaunched and heals); the run trained on without them meanwhile."""
        if self.core.backend is None or choose_spare(self.core, run.id, "") is None:
            return
        for incident in self.progress.open_incidents(run):
            if incident.replica_group is None or not is_failure(incident):
                continue
            if took_step(self.core.store, incident.id, ActionKind.LAUNCH):
                continue
            log.info(
                "run %s: a spare is available; replica group %d's recovery goes on", run.id, incident.replica_group
            )
            self.core.recovery.start(run.id, incident.id, failure_of(incident), now_s)
            return  # one at a time: the next pass takes the next group up

    def _retry_waiting(self, run: RunRow, now_s: float) -> None:
        """A run waits for a spare: once one is there (a node uncordoned or added), go on with its recovery."""
        if self.core.backend is None or choose_spare(self.core, run.id, "") is None:
            return
        incident = unfinished_incident(self.core.store, run.id)
        if incident is None:
            return
        log.info("run %s: a spare is available; incident %d's recovery goes on", run.id, incident.id)
        self.core.store.update_run(run.id, now_s, state=RunState.RECOVERING)
        self.core.recovery.start(run.id, int(incident.id), failure_of(incident), now_s)
