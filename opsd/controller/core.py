"""What the controller holds: its state store, its configuration, its backend, and what the heartbeats say, in
memory. The controller's parts (``intake``, ``detection``, ``operations``, ``reads``, ...) are objects given this
core (``opsd.controller.controller`` wires them).

Durable state is in the ``StateStore``; what the heartbeats say (liveness, progress, compute samples, checkpoint
costs) is kept in memory and rebuilt within seconds after a restart: per node (``NodeLive``) and per run, one record
(``RunMemory``) dropped ``forget_finished_s`` after the run ended. Heartbeats come in on the API's threads,
detection passes on a thread of their own, recoveries on theirs: ``lock`` guards what is in memory, and is held
only while it is read or changed, never while the store or the backend is waited on, so that heartbeats are not
held up by a pass. The API's event loop never waits for it: what it finds the lock held for is left in ``deferred``
and taken, in order, by the lock's next holder (``drain``). On a machine whose cores are all busy, a thread holding
the lock is put off its core for a scheduler's time slice or more, and the loop, waiting for it, answered no one
meanwhile (3 to 55 ms at 12,288 nodes, as a lock that timed itself showed).
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

from opsd.controller.config import ControllerConfig
from opsd.controller.groups import GroupDown
from opsd.controller.holds import Holds
from opsd.controller.live import (
    NodeLive,
    RankLive,
    Ratios,
    RunLive,
    RunMemory,
    SlotClock,
    Window,
    comm_totals,
)
from opsd.controller.port import Backend
from opsd.controller.rows import LaunchSample, RunRow, pipeline_view
from opsd.controller.state import StateStore
from opsd.controller.tracing import IncidentTracing
from opsd.policy.detection import Failure
from opsd.policy.pipeline import run_bubble
from opsd.policy.telemetry import TelemetryPlan
from opsd.protocol.policy_file import Command

log = logging.getLogger(__name__)

LAUNCH_RECORD_S = 10.0  # a launch's record is written at most this often while it progresses (6x: while it does not)


class Recoveries(Protocol):
    """What the detection pass and the operator's actions ask of the recovery executor."""

    def start(self, run: str, incident_id: int, failure: Failure, now_s: float) -> None:
        """Carry out (or go on with) the recovery of ``run`` from ``failure``, without blocking the caller."""
        ...


class ControllerCore:
    recovery: Recoveries

    def __init__(
        self,
        store: StateStore,
        config: ControllerConfig | None = None,
        backend: Backend | None = None,
        tracing: IncidentTracing | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``clock``: the controller's wall clock, for what it does on its own threads (a recovery's steps); the
        passes and the heartbeats are given their time (``now_s``)."""
        self.store = store
        self.holds = Holds(store.engine)  # maintenance windows: recovery actions held (opsd maintenance)
        self.config = config or ControllerConfig()
        self.backend = backend
        self.tracing = tracing or IncidentTracing()  # the incidents' traces (none exported by default)
        self.clock = clock
        self.lock = threading.RLock()
        self.ticking = threading.Lock()  # one detection pass at a time
        self.scoring_lock = threading.Lock()  # one run's scoring and cadence planning at a time
        self.deferred: deque[Callable[[], object]] = deque()  # left by the API's event loop while the lock was held
        self.deferred_total = 0  # what was left so, in all
        self.nodes: dict[str, NodeLive] = {}
        self.memory: dict[str, RunMemory] = {}  # run -> what is kept of it in memory (dropped after it ended)
        self.forgotten: set[str] = set()  # finished runs whose memory was dropped: heartbeats naming them are ignored
        self.known_runs: set[str] = set()  # runs the store has (recorded once, not at every heartbeat)
        self.heartbeats_total = 0
        self.datagrams_total = 0  # liveness datagrams taken
        self.liveness_port: int | None = None  # where the API takes liveness datagrams (None: it does not)
        self.heartbeat_port: int | None = None  # where the API's heartbeat process answers heartbeats (None: none)
        self.telemetry = TelemetryPlan(self.config.telemetry.min_interval_s, self.config.sample_slot_s, "at start")
        self.telemetry_due_s = -math.inf  # when the interval is planned again
        self.telemetry_nodes = 1  # the nodes known when it was last planned
        self.slots = SlotClock(self.config.sample_slot_s)  # the compute samples' slots (``telemetry``'s length)

    def drain(self) -> None:
        """Take what the API's event loop left while the lock was held, in order (the caller holds ``lock``)."""
        deferred = self.deferred
        while deferred:
            deferred.popleft()()

    def defer(self, take: Callable[[], object]) -> None:
        """Call ``take`` under the lock if it is free at once (after what was left before it), else leave it to the
        lock's next holder. For the API's event loop, which never waits for the lock."""
        if not self.lock.acquire(blocking=False):
            self.deferred.append(take)
            self.deferred_total += 1
            return
        try:
            self.drain()
            take()
        finally:
            self.lock.release()

    def drain_now(self) -> bool:
        """``drain`` if the lock is free at once; whether nothing is left (the API's event loop, again and again
        until then, so that nothing waits for the next heartbeat)."""
        if not self.deferred:
            return True
        if not self.lock.acquire(blocking=False):
            return False
        try:
            self.drain()
        finally:
            self.lock.release()
        return True

    def remember(self, run: str) -> RunMemory:
        """The record of ``run`` in memory, made when there is none (the caller holds ``lock``)."""
        memory = self.memory.get(run)
        if memory is None:
            memory = self.memory[run] = RunMemory()
        return memory

    def live_of(self, run: str) -> RunLive | None:
        """The current launch's ranks of ``run``, as heard so far (the caller holds ``lock``)."""
        memory = self.memory.get(run)
        return memory.live if memory is not None else None

    @property
    def ranks(self) -> dict[str, dict[int, RankLive]]:
        """run -> rank -> what its heartbeats say."""
        return {run: m.live.ranks for run, m in self.memory.items() if m.live is not None}

    def _run_live(self, run: str) -> RunLive:
        memory = self.remember(run)
        if memory.live is None:
            stragglers = self.config.stragglers
            memory.live = RunLive(
                Window(self.config.run_history), Ratios(stragglers.window, stragglers.threshold_ratio)
            )
        return memory.live

    def settle(self, run: str, now_s: float) -> None:
        """``run`` ended with nothing left to close: its memory is dropped ``forget_finished_s`` later."""
        with self.lock:
            self.remember(run).settled_s = now_s

    def settled(self, run: str) -> bool:
        """Whether ``run`` ended with nothing left to close (or was forgotten since)."""
        with self.lock:
            memory = self.memory.get(run)
            return run in self.forgotten or (memory is not None and memory.settled_s is not None)

    def forget_settled(self, now_s: float) -> None:
        """Drop the memory of the runs settled more than ``forget_finished_s`` ago."""
        with self.lock:
            due = [
                run
                for run, m in self.memory.items()
                if m.settled_s is not None and now_s - m.settled_s >= self.config.forget_finished_s
            ]
            for run in due:
                del self.memory[run]
                self.forgotten.add(run)

    # -- the ranks' policy -------------------------------------------------------------------------------------
    def add_command(self, run: str, command: Command) -> None:
        """Put ``command`` in the policy of ``run``'s ranks, once per id."""
        with self.lock:
            memory = self.remember(run)
            commands = memory.commands if memory.commands is not None else []
            if all(c.id != command.id for c in commands):
                memory.commands = [*commands, command]

    def remove_command(self, run: str, command_id: str) -> None:
        with self.lock:
            memory = self.remember(run)
            memory.commands = [c for c in memory.commands or [] if c.id != command_id]

    def checkpoint_step_ahead(self, run: str) -> int | None:
        """A step far enough ahead that every rank has read a policy naming it before it gets there (the one-off
        checkpoint of a graceful restart); None when the run's ranks are not progressing. The lead is
        ``restart_lead_s``, and at least three telemetry intervals: the newest step known is up to an interval old,
        and the policy reaches a node with its next heartbeat, up to an interval later."""
        with self.lock:
            live = self.live_of(run)
            if live is None or not live.step_times_s or live.newest_step < 0:
                return None
            step_s = statistics.median(live.step_times_s)
            newest = live.newest_step
            lead_s = max(self.config.restart_lead_s, 3 * self.telemetry.interval_s)
        lead = max(self.config.restart_min_lead_steps, math.ceil(lead_s / max(step_s, 1e-6)))
        return newest + lead

    def ask_checkpoint(self, run: str, step: int | None) -> None:
        """Publish (or, with None, withdraw) a one-off checkpoint at ``step`` in the policy of ``run``."""
        with self.lock:
            self.remember(run).checkpoint_at = step

    # -- ranks and launches ------------------------------------------------------------------------------------
    def rank_exited(
        self,
        run: str,
        rank: int,
        node: str,
        exit_code: int,
        now_s: float,
        *,
        launch: int | None = None,
        group: int | None = None,
    ) -> None:
        """The backend saw a rank process end: of ``launch`` (the launch its process was started in, when the
        backend says) and replica ``group``. The end of a process of a launch older than its rank's current one is
        not this launch's failure, and is left out: a stopped group's rank whose end is reported after the group
        was launched again would otherwise fail every launch after it."""
        with self.lock:
            memory = self.remember(run)
            current = memory.group_launches.get(group, memory.launch) if group is not None else memory.launch
            if launch is not None and current is not None and launch < current:
                log.info(
                    "run %s: rank %d of launch %d ended (%d) after launch %d began: not its failure",
                    run,
                    rank,
                    launch,
                    exit_code,
                    current,
                )
                return
            run_live = self._run_live(run)
            live = run_live.ranks.get(rank)
            if live is None:
                live = RankLive(rank, node, -1, now_s, now_s, Window(2), launch=launch, group=group)
                run_live.place(live)
            live.exit_code = exit_code
            run_live.exited.add(rank)

    def rank_node(self, run: str, rank: int) -> str | None:
        """The node the current launch's ``rank`` runs on, as its heartbeats say (None: not heard from)."""
        with self.lock:
            live = self.live_of(run)
            found = live.ranks.get(rank) if live is not None else None
            return found.node if found is not None else None

    def running_ranks(self, run: str) -> list[int]:
        """The ranks of the run's current launch heard from and not exited."""
        with self.lock:
            live = self.live_of(run)
            return sorted(r for r in live.ranks if r not in live.exited) if live is not None else []

    def ranks_ended(self, run: str) -> bool:
        """Whether a rank of the run's current launch has exited (the backend said so)."""
        with self.lock:
            live = self.live_of(run)
            return bool(live is not None and live.exited)

    def launched(
        self, run: str, now_s: float, launch: int | None = None, group_launches: Sequence[int] | None = None
    ) -> None:
        """The backend says the new launch runs. Its ranks are known by ``launch``, the launch their reports carry,
        when the backend names one: reports of an earlier launch are ignored, and the new launch's are taken
        whenever they come (before this call too: its ranks may have stepped, or even finished, while a
        controller that took over waited for the cluster). Reports without a launch are told apart by time: what
        agents report from before ``now_s`` belongs to the old one. (On a cluster a stopped rank may go on
        reporting for its grace period, after the relaunch began; the relaunch is done only once the old ranks are
        gone.) ``group_launches``: a fault-tolerant run's groups launched apart, each at its own launch."""
        with self.lock:
            memory = self.remember(run)
            memory.live, memory.stragglers, memory.recorded = None, [], None
            memory.launched_s = now_s
            memory.whole_launch(group_launches or ())
            if launch is not None:
                memory.launch = launch

    def forget_ranks(self, run: str, now_s: float, ended_launch: int | Sequence[int] | None = None) -> None:
        """A relaunch: the ranks of ``run`` start over (their progress and samples belong to the old launch, whose
        record is written first); what agents report from before ``now_s`` is ignored. ``ended_launch``: the
        launch the recovery stopped, when the backend named it (or each replica group's, in order): the newest step
        it made is taken from its own ranks alone (a controller that took over may have heard from the new launch
        already)."""
        row = self.store.run(run)
        if row is not None and row.generation > 0:
            self.record_launch(run, row.generation, now_s)
        with self.lock:
            memory = self.remember(run)
            memory.comms_before = memory.comms.totals() if memory.comms is not None else {}
            ended, memory.live, memory.recorded, memory.stragglers = memory.live, None, None, []
            memory.ended_since_s = memory.launched_s
            memory.ended_launch = ended_launch if isinstance(ended_launch, int) else memory.launch
            if ended is None:
                memory.ended_step = -1
            elif ended_launch is None:
                memory.ended_step = ended.newest_step
            else:
                steps = [r.step for r in ended.ranks.values() if r.launch is None or r.launch == _of(ended_launch, r)]
                memory.ended_step = max(steps, default=-1)
            memory.launched_s = now_s

    def forget_group(self, run: str, group: int, now_s: float) -> None:
        """Replica group ``group`` of a fault-tolerant run was stopped: its ranks leave the launch (the others train
        on), and what it had done and what the others had waited for a quorum so far are kept for its incident."""
        with self.lock:
            memory = self.remember(run)
            live = memory.live
            mine = [r for r in live.ranks.values() if r.group == group] if live is not None else []
            others = [r for r in live.ranks.values() if r.group != group] if live is not None else []
            if group not in memory.groups_down:
                memory.groups_down[group] = GroupDown.stopped(mine, others, now_s)
            for r in mine:
                assert live is not None
                live.remove(r.rank)

    def group_launched(self, run: str, group: int, launch: int | None) -> None:
        """Replica group ``group`` runs again (its launch ``launch``, when the backend named it): its ranks'
        reports are taken again."""
        with self.lock:
            memory = self.remember(run)
            if launch is not None:
                memory.group_launches[group] = launch
                live = memory.live
                ranks = live.ranks.values() if live is not None else ()
                older = [r.rank for r in ranks if r.group == group and r.launch is not None and r.launch < launch]
                for rank in older:  # the group's ranks of an earlier launch (an end reported late): not this one's
                    assert live is not None
                    live.remove(rank)
            down = memory.groups_down.get(group)
            if down is not None:
                down.relaunched = True

    def recall_groups(self, run: RunRow, now_s: float) -> None:
        """A controller that took a fault-tolerant run up knows its groups' launches from the store: the groups out
        waiting for a node are down (their ranks' last reports, still remembered by their agents, are not taken)."""
        with self.lock:
            memory = self.remember(run.id)
            if memory.group_launches or not run.groups:
                return
            memory.group_launches = {g: launch.launch for g, launch in run.groups.items()}
            for g, launch in run.groups.items():
                if launch.out:
                    memory.groups_down.setdefault(g, GroupDown(-1, now_s, {}))

    def rank_groups(self, run: str) -> dict[int, int]:
        """A fault-tolerant run's ranks of the current launches: rank -> replica group, as their reports say."""
        with self.lock:
            live = self.live_of(run)
            return {r.rank: r.group for r in live.ranks.values() if r.group is not None} if live else {}

    def ended_step(self, run: str) -> int:
        """The newest step the launch before the current one made (-1: not known)."""
        with self.lock:
            memory = self.memory.get(run)
            return memory.ended_step if memory is not None else -1

    def final_step(self, run: str) -> int:
        """The step a run that finished ended at: the newest its last launch reported, and at least the checkpoint
        that launch resumed from (a launch that resumes from the last step has nothing left to do, and exits before
        any report); the newest step the run reported when its last launch said nothing."""
        with self.lock:
            live = self.live_of(run)
            newest = live.newest_step if live is not None else -1
            said = [r.resumed_from_step for r in live.ranks.values() if r.resumed_from_step is not None] if live else []
        resumed = self.backend.resumed_from(run) if self.backend is not None else None
        ended = max([newest, *said, *([resumed] if resumed is not None else [])])
        if ended >= 0:
            return ended
        row = self.store.run(run)
        return row.last_step if row is not None else -1

    def launch_comm_seconds(self, run: str) -> dict[tuple[str, str, str], float]:
        """The collective seconds of the run's current launch, by (phase, dimension, op): the totals the agents
        report less those at the launch's start (after a controller restart: all they report)."""
        with self.lock:
            memory = self.memory.get(run)
            if memory is None or memory.comms is None:
                return {}
            taken, before = memory.comms.snapshot(), memory.comms_before
        totals = comm_totals(*taken)  # without the lock, which heartbeats wait for
        return {k: v - before.get(k, 0.0) for k, v in totals.items() if v - before.get(k, 0.0) > 0}

    def record_launch(self, run: str, generation: int, now_s: float) -> None:
        """Write what the current launch of ``run`` measured (``StateStore.record_launch``): what ``opsd status``
        shows of a finished run, and its flame graph after the run or a controller restart."""
        with self.lock:
            memory = self.remember(run)
            live = memory.live
            held = list(live.ranks.values()) if live is not None else []
            _, step_then = memory.recorded or (0.0, -1)
            newest = live.newest_step if live is not None else -1
            memory.recorded = (now_s, max(newest, step_then))
        # the sums over the ranks without the lock, which heartbeats wait for (98,304 ranks: ~50 ms); a rank's record
        # may change meanwhile, as it would a moment later
        ranks = [r for r in held if r.step >= 0]
        sample = LaunchSample(
            first_step=min((r.step for r in ranks), default=None) if step_then < 0 else None,
            last_step=newest if newest >= 0 else None,
            ranks=len(ranks),
            progressed=bool(ranks) and newest > step_then,
            mfu_ratio=math.fsum(r.mfu_ratio for r in ranks) / len(ranks) if ranks else 0.0,
            tokens_per_s=max((r.job_tokens_per_s for r in ranks), default=0.0),
            pipeline=pipeline_view(run_bubble((r.bubble for r in ranks if r.bubble is not None), self.config.pipeline)),
        )
        comm = {";".join(stack): seconds for stack, seconds in self.launch_comm_seconds(run).items()}
        if ranks or comm:  # else nothing was heard of it
            self.store.record_launch(run, generation, now_s, replace(sample, comm=comm))

    def last_recorded_s(self, run: str) -> float:
        """When the current launch of ``run`` was last recorded (inf when it has no ranks to record)."""
        with self.lock:
            memory = self.memory.get(run)
            if memory is None or memory.live is None or not memory.live.ranks:
                return math.inf
            return memory.recorded[0] if memory.recorded is not None else -math.inf

    def launch_record_due(self, run: str, now_s: float) -> bool:
        """Whether the current launch of ``run`` has news to record: ranks heard from, and ``LAUNCH_RECORD_S``
        since its last record (or none yet)."""
        with self.lock:
            memory = self.memory.get(run)
            if memory is None or memory.live is None or not memory.live.ranks:
                return False
            at_s, step = memory.recorded or (-math.inf, -1)
            news = memory.live.newest_step != step
            return (now_s - at_s >= LAUNCH_RECORD_S and news) or now_s - at_s >= 6 * LAUNCH_RECORD_S


def _of(ended: int | Sequence[int], rank: RankLive) -> int | None:
    """The launch a recovery stopped that ``rank`` was of: the whole job's, or its replica group's."""
    if isinstance(ended, int):
        return ended
    return ended[rank.group] if rank.group is not None and 0 <= rank.group < len(ended) else None
