"""The controller's intake: the agents' heartbeats (``opsd.protocol.heartbeat``), taken into memory.

A heartbeat writes to the state store only when it brings something new (a run, a node, GPU events); nearly all of
them are taken in memory alone, at the nodes' rate (3,072 a second for 24,576 GPUs whose agents send no liveness
datagrams; ~1,400 for 98,304 GPUs whose agents do: ``opsd.controller.liveness``). The reply acknowledges the GPU
events handled and carries the policy for the node's ranks (the checkpoint cadence, a one-off checkpoint,
commands: docs/protocol.md), the interval at which to send the ranks, and the port of the liveness datagrams.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from functools import partial

from opsd.controller.core import ControllerCore
from opsd.controller.live import NodeLive, RankLive, RunComms, Window, comm_totals
from opsd.controller.liveness import Liveness
from opsd.controller.rows import RunSpec
from opsd.policy.detection import GpuEvent
from opsd.policy.pipeline import RankBubble
from opsd.protocol.heartbeat import CommRow, Heartbeat, HeartbeatRank, HeartbeatReply
from opsd.protocol.policy_file import EMPTY, Cadence, CheckpointCadence, FailedGroup, Policy
from opsd.protocol.states import NodeRole
from opsd.protocol.wire import CollectiveWait
from opsd.protocol.xid_table import XidAction

log = logging.getLogger(__name__)

#: the XID actions that open an incident (the others are acknowledged at once)
#: the events that ask for a recovery, by their action on the wire (a str there: an action a newer agent adds must not
#: refuse its heartbeat)
ACTIONABLE_EVENTS = {a.value: a for a in (XidAction.CORDON_AND_SWAP, XidAction.RESTART_JOB)}


class Intake:
    def __init__(self, core: ControllerCore, liveness: Liveness) -> None:
        self.core = core
        self.liveness = liveness

    def heartbeat(self, body: Heartbeat, now_s: float, *, wait: bool = True) -> HeartbeatReply:
        """Take one validated heartbeat; the reply: events acknowledged, and the policy. ``wait=False`` (the API's
        event loop, for a heartbeat that writes nothing: ``heartbeat_writes``): when the lock is held elsewhere, the
        heartbeat is left to its next holder (``drain``) and answered from what the run's last heartbeat was told."""
        node = body.node
        events = body.events
        runs = sorted({r.run for r in body.ranks})
        # the store first, without the lock (written only when something is new: a run, a node, events)
        for run in runs:
            if run not in self.core.known_runs:
                if self.core.store.create_run(run, RunSpec(observed=True), now_s):
                    log.info("run %s first seen in a heartbeat from node %s", run, node)
                self.core.known_runs.add(run)
        known = self.core.store.node(node)
        if runs and (known is None or known.run is None):
            self.core.store.upsert_node(node, now_s, run=runs[0], role=NodeRole.ACTIVE)
            known = self.core.store.node(node)
        acked = int(known.events_acked) if known else 0
        run_of_node = known.run if known else None
        if not self.core.lock.acquire(blocking=wait or bool(events)):
            reply = self._reply_later(node, acked, run_of_node)
            if reply is not None:
                self.core.deferred.append(partial(self._take, body, acked, run_of_node, now_s))
                self.core.deferred_total += 1
                return reply
            self.core.lock.acquire()  # rare: its node's GPU events wait for their incident, or its run was told nothing
        try:
            self.core.drain()
            ack, interval_s, policy = self._take(body, acked, run_of_node, now_s)
        finally:
            self.core.lock.release()
        if ack > acked:
            self.core.store.ack_events(node, ack, now_s)
        return HeartbeatReply(
            ack_events_up_to=ack,
            policy=None if policy.empty else policy,
            telemetry_interval_s=interval_s,
            liveness_port=self.core.liveness_port,
            heartbeat_port=self.core.heartbeat_port,
        )

    def take_many(self, bodies: Sequence[tuple[Heartbeat, float]], *, wait: bool = True) -> bool:
        """Heartbeats answered by the API's heartbeat process (``opsd.api.heartbeat_worker``), each ``(body, when it
        was taken)``, taken under one hold of the lock. None of them writes to the store (the caller sent those that
        would to ``heartbeat``): that process answers a known node of known runs without GPU events only.
        ``wait=False`` (the API's event loop): False, and nothing taken, when the lock is held elsewhere."""
        rows = [(body, now_s, self.core.store.node(body.node)) for body, now_s in bodies]  # the store without the lock
        if not self.core.lock.acquire(blocking=wait):
            return False
        try:
            self.core.drain()
            for body, now_s, known in rows:
                self._take(body, int(known.events_acked) if known else 0, known.run if known else None, now_s)
        finally:
            self.core.lock.release()
        return True

    def _take(self, body: Heartbeat, acked: int, run_of_node: str | None, now_s: float) -> tuple[int, float, Policy]:
        """Take ``body`` into memory (the caller holds the lock); the events acknowledged, the interval and the
        policy."""
        node, events = body.node, body.events
        self.core.heartbeats_total += 1
        live = self.core.nodes.get(node)
        if live is None:
            live = self.core.nodes[node] = NodeLive(node, now_s, Window(self.core.config.history))
        live.posted(now_s)
        for e in events:
            action = ACTIONABLE_EVENTS.get(e.action)
            if e.seq > acked and action is not None:
                event = GpuEvent(node, e.gpu, e.xid, action, e.reason, e.time_s, e.trace_id, e.span_id)
                live.events.setdefault(e.seq, event)
        for r in body.ranks:
            self._rank(r, node, now_s)
        for t in body.timeouts:
            self._timeout(t, node)
        if body.comms:
            self._comms(body.comms, node)
        interval_s = self.liveness.telemetry_interval_s(now_s)  # after the ranks: a job's world size said first counts
        # events that need no action are acknowledged at once; the others once their incident is recorded
        newest = max((e.seq for e in events), default=acked)
        ack = min(live.events) - 1 if live.events else max(acked, newest)
        policy = self._policy(run_of_node) if run_of_node is not None else EMPTY
        return ack, interval_s, policy

    def _reply_later(self, node: str, acked: int, run: str | None) -> HeartbeatReply | None:
        """The reply to a heartbeat left for later, read without the lock (each value is replaced whole): its
        node's acknowledgement in the store, the policy its run's last heartbeat was told, the interval planned
        last. None when it cannot be answered so: its node waits on GPU events, or its run was told nothing yet."""
        live = self.core.nodes.get(node)
        if live is not None and live.events:
            return None
        policy: Policy | None = EMPTY
        if run is not None:
            memory = self.core.memory.get(run)
            policy = memory.policy if memory is not None else None
        if policy is None:
            return None
        return HeartbeatReply(
            ack_events_up_to=acked,
            policy=None if policy.empty else policy,
            telemetry_interval_s=self.core.telemetry.interval_s,
            liveness_port=self.core.liveness_port,
            heartbeat_port=self.core.heartbeat_port,
        )

    def register(self, bodies: Sequence[Heartbeat], now_s: float) -> None:
        """What the heartbeats ``bodies`` would write first, written at once: their new runs, and their nodes not yet
        members of a run made active members of one, in one transaction (``heartbeat`` then finds them known). For
        the heartbeats that queue up while a job of thousands of nodes starts."""
        for run in sorted({r.run for b in bodies for r in b.ranks} - self.core.known_runs):
            if self.core.store.create_run(run, RunSpec(observed=True), now_s):
                log.info("run %s first seen in a heartbeat", run)
            self.core.known_runs.add(run)
        joining: dict[str, str] = {}
        for body in bodies:
            known = self.core.store.node(body.node)
            if body.ranks and (known is None or known.run is None):
                joining.setdefault(body.node, min(r.run for r in body.ranks))
        if joining:
            self.core.store.activate_nodes(joining, now_s)

    def heartbeat_writes(self, body: Heartbeat) -> bool:
        """Whether taking ``body`` may write to the store (its node or a run of it is new, or it carries events);
        the others are taken in memory alone."""
        known = self.core.store.node(body.node)
        if known is None or known.run is None or body.events:
            return True
        return any(r.run not in self.core.known_runs for r in body.ranks)

    def policies(self) -> dict[str, Policy]:
        """The policy of each run in memory (for the API's heartbeat process): made now if the lock is free at once,
        else as the run's last heartbeat was told (the API's event loop never waits for the lock)."""
        if not self.core.lock.acquire(blocking=False):
            return {run: m.policy for run, m in list(self.core.memory.items()) if m.policy is not None}
        try:
            return {run: self._policy(run) for run in list(self.core.memory)}
        finally:
            self.core.lock.release()

    def _policy(self, run: str) -> Policy:
        """The policy for the ranks of ``run`` (docs/protocol.md); called with the lock held."""
        memory = self.core.memory.get(run)
        if memory is None:
            return EMPTY
        c, p = memory.cadence, memory.previous_cadence
        checkpoint = None
        if c is not None:
            previous = Cadence(every_steps=p.every_steps, from_step=p.from_step) if p is not None else None
            checkpoint = CheckpointCadence(every_steps=c.every_steps, from_step=c.from_step, previous=previous)
        # once a run had a command, an empty tuple: agents then rewrite a file that held one
        commands = tuple(memory.commands) if memory.commands is not None else None
        failed = memory.failed_groups
        groups = (
            tuple(FailedGroup(group=g, incident=i) for g, i in sorted(failed.items())) if failed is not None else None
        )
        policy = Policy(
            checkpoint=checkpoint, checkpoint_at_step=memory.checkpoint_at, commands=commands, failed_groups=groups
        )
        memory.policy = policy
        return policy

    def _comms(self, rows: list[CommRow], node: str) -> None:
        """A node's collective totals per run (cumulative): they replace its last ones; runs the store does not
        have are ignored (memory holds real runs only)."""
        by_run: dict[str, list[CommRow]] = {}
        for row in rows:
            by_run.setdefault(row[0], []).append(row)
        for run, of_run in by_run.items():
            if run in self.core.known_runs and run not in self.core.forgotten:
                memory = self.core.remember(run)
                if memory.comms is None:
                    memory.comms = RunComms()
                memory.comms.update(node, of_run)

    def comm_seconds(self, run: str) -> dict[tuple[str, str, str], float]:
        """The run's collective seconds by (phase, dimension, op), summed over its nodes since their agents
        started (docs/flamegraph.md)."""
        with self.core.lock:
            memory = self.core.memory.get(run)
            if memory is None or memory.comms is None:
                return {}
            taken = memory.comms.snapshot()
        return comm_totals(*taken)  # without the lock, which heartbeats wait for

    def _rank(self, r: HeartbeatRank, node: str, now_s: float) -> None:
        run, rank = r.run, r.rank
        if run in self.core.forgotten:
            return  # an agent still remembers a rank of a run that ended a while ago
        memory = self.core.remember(run)
        group = r.ft.replica_group if r.ft is not None else None
        down = memory.groups_down.get(group) if group is not None else None
        if down is not None and not down.relaunched:
            return  # its replica group was stopped: a rank of the stopped launch, still remembered by its agent
        # a fault-tolerant run's groups are launched apart: a rank is of its group's launch, or of an earlier one
        launch = memory.group_launches.get(group, memory.launch) if group is not None else memory.launch
        if r.launch is not None and launch is not None:
            if r.launch < launch:  # a rank of an earlier launch (on a cluster: stopping, or remembered by its agent)
                if group is None and r.launch == memory.ended_launch:
                    memory.ended_step = max(memory.ended_step, r.step)  # the ended launch's steps, heard late
                return
        elif r.last_report_unix_s < memory.launched_s:  # the agent still remembers a rank of an earlier launch
            if group is None and r.last_report_unix_s >= memory.ended_since_s:
                memory.ended_step = max(memory.ended_step, r.step)  # the ended launch's steps, heard late
            return
        run_live = self.core._run_live(run)
        live = run_live.ranks.get(rank)
        if live is None or live.node != node:
            live = RankLive(rank, node, -1, now_s, now_s, Window(self.core.config.history))
            run_live.place(live)
        live.seen_s = now_s
        if r.activity != live.activity:
            if live.activity and not r.activity:  # it trains again: its stall (a hang) is counted from now
                live.progress_s = now_s
                run_live.latest_progress_s = max(run_live.latest_progress_s, now_s)
            live.activity, live.activity_since_s = r.activity, now_s - r.activity_s
        if r.world_size and r.world_size != run_live.world_size:
            run_live.world_size = r.world_size
            self.core.telemetry_due_s = -math.inf  # the interval planned again at once, for the job's size
        live.stage = r.coords.get("pp", 0)
        step = r.step
        slot = self.core.slots.index(now_s)
        steps_total, compute_total_s = r.steps_total, r.compute_total_s
        if steps_total:  # the agent's running sums: the mean compute of the steps since the last heartbeat
            steps_before, compute_before_s = live.steps_total, live.compute_total_s
            live.steps_total, live.compute_total_s = steps_total, compute_total_s
            if 0 <= steps_before < steps_total and compute_total_s >= compute_before_s:
                run_live.add_sample(live, slot, compute_total_s - compute_before_s, steps_total - steps_before)
        if step != live.step:
            if step > live.step >= 0:
                step_s = r.step_s
                live.step_times_s.append(step_s)
                run_live.step_times_s.append(step_s)
                if not steps_total:  # an agent without running sums: the last step's compute
                    run_live.add_sample(live, slot, r.compute_s, 1)
            live.step = step
            live.progress_s = now_s
            live.timeout = ""  # it stepped on: whatever it waited on is over
            run_live.waiting.discard(rank)
            run_live.newest_step = max(run_live.newest_step, step)
            run_live.latest_progress_s = max(run_live.latest_progress_s, now_s)
        live.mfu_ratio = r.mfu_ratio
        live.job_tokens_per_s = r.job_tokens_per_s
        live.resumed_from_step = r.resumed_from_step
        if r.ft is not None:
            if r.ft.discarded_steps != live.discarded_total:
                live.discarded_before, live.discarded_changed_s = live.discarded_total, now_s
            live.group, live.quorum_replicas, live.quorum_wait_total_s, live.discarded_total = (
                group,
                r.ft.quorum_replicas,
                r.ft.quorum_wait_total_s,
                r.ft.discarded_steps,
            )
        live.launch = r.launch
        p = r.pipeline
        live.bubble = None
        if p is not None:
            live.bubble = RankBubble(rank, live.stage, p.bubble_ratio, p.schedule, p.stages, p.microbatches)
        checkpoints = r.checkpoints
        if checkpoints != live.checkpoints:
            run_live.count_checkpoints(live, checkpoints, r.checkpoint_blocking_s, r.checkpoint_total_s)
            if run_live.checkpoints >= len(run_live.ranks) * (run_live.checkpoints_done + 1):
                run_live.checkpoints_done = run_live.checkpoints // len(run_live.ranks)
                memory.checkpointed_s = now_s  # the last rank finished its save: the checkpoint is committed

    def _timeout(self, t: CollectiveWait, node: str) -> None:
        run, rank = t.run, t.rank
        memory = self.core.memory.get(run)
        run_live = memory.live if memory is not None else None
        live = run_live.ranks.get(rank) if run_live is not None else None
        if memory is None or run_live is None or live is None or live.node != node or t.time_unix_s < memory.launched_s:
            return  # a rank of an earlier launch, or one not heard from yet
        if t.step >= live.step:  # still waiting in the step after its last report
            live.timeout = f"rank {rank} waited {t.waited_s:.0f} s in {t.op} on {t.dim}"
            run_live.waiting.add(rank)
