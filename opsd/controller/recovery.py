"""The recovery executor: carries out an incident's plan (``opsd.policy.recovery``) through the backend port.

Each step is recorded in the state store under its request id before it is carried out and marked done (with what
it did) after; a step found done is skipped. So a recovery can be started again at any moment — by the detection
pass once a spare is there, by an operator, or by a controller that takes a run up after its predecessor died
(``take_up``) — and it goes on from where it was, each step done once. What the controller itself does around a
step (choosing the spare and writing it to the incident before the node changes role, the node roles, the run's
generation and state) is written so that a repeat finds it done.

Recoveries run on a thread per run (``start``); one at a time per run. A step the backend answers ``Pending`` (under
way: a cluster's scheduler placing pods) is asked again after ``retry_after_s`` until it is done, for at most
``step_timeout_s``; one it answers ``Failed`` with a transient error is tried again after ``retry_after_s`` (at most
``step_attempts`` in all, each wait at most ``step_retry_max_s``); any other failure fails the run. A swap that
finds no spare (and may not shrink) stops the ranks before the run waits (``_stop_to_wait``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from msgspec import structs

from opsd.checkpoints.store import newest_checkpoint
from opsd.controller.calls import BackendCalls, StepFailedError
from opsd.controller.core import ControllerCore
from opsd.controller.flight import collect_dumps, culprits
from opsd.controller.incidents import failure_key, failure_of, generation_of, unfinished_incident
from opsd.controller.rows import GroupLaunch, RunRow, RunSpec
from opsd.controller.spares import choose_spare
from opsd.policy.detection import Failure, FailureKind
from opsd.policy.recovery import (
    DUMP_KINDS,
    Quarantine,
    hang_strikes,
    plan_recovery,
    quarantine_after_hangs,
    request_id,
    shrinks_without_spare,
)
from opsd.protocol.records import Action
from opsd.protocol.states import ActionKind, ActionState, NodeRole, RunState
from opsd.protocol.steps import (
    Blame,
    CheckpointStep,
    CheckpointTaken,
    Cordoned,
    CordonStep,
    Culprit,
    Dumped,
    DumpStep,
    Launched,
    LaunchStep,
    Result,
    SpareTaken,
    Step,
    Stopped,
    StopStep,
    Swap,
    TakeSpareStep,
    result_of,
    result_record,
    step_args,
)

log = logging.getLogger(__name__)

HANG_KINDS = frozenset(k.value for k in DUMP_KINDS)  # the incidents a hang's dumps are taken for

#: where a step can be interrupted, for ``Recovery.on_step`` (tests, fault injection): after it is recorded, after
#: the backend carried it out, after it is recorded done
RECORDED, CARRIED_OUT, COMPLETED = "recorded", "carried_out", "completed"
OnStep = Callable[[str, Action], None]


class WaitForSpare(Exception):  # noqa: N818 (a signal within the executor, not an error)
    """No spare is left and the run may not shrink: the recovery waits (the detection pass takes it up)."""


class Recovery(BackendCalls):
    """The recovery executor of a controller (``core``): its store, configuration, backend and policy state."""

    def __init__(self, core: ControllerCore, *, sleep: Callable[[float], None] = time.sleep) -> None:
        self.core = core
        self.sleep = sleep
        self.on_step: OnStep | None = None  # called at each point a step passes (see RECORDED, ...)
        self.threaded = True  # False: ``start`` carries the recovery out before it returns (tests)
        self._lock = threading.Lock()
        self._threads: dict[str, threading.Thread] = {}

    # -- starting ----------------------------------------------------------------------------------------------
    def start(self, run: str, incident_id: int, failure: Failure, now_s: float) -> None:
        """Carry out (or go on with) the recovery on a thread of its own; nothing when one of ``run`` is under way."""
        if not self.threaded:
            self._run_guarded(run, incident_id, failure, now_s)
            return
        with self._lock:
            running = self._threads.get(run)
            if running is not None and running.is_alive():
                return
            thread = threading.Thread(
                target=self._run_guarded, args=(run, incident_id, failure, now_s), name=f"opsd-recovery-{run}"
            )
            self._threads[run] = thread
            thread.start()

    def join(self, run: str, timeout_s: float | None = None) -> None:
        """Wait for the recovery of ``run`` under way, if any."""
        with self._lock:
            thread = self._threads.get(run)
        if thread is not None:
            thread.join(timeout_s)

    def busy(self) -> bool:
        with self._lock:
            return any(t.is_alive() for t in self._threads.values())

    def _run_guarded(self, run: str, incident_id: int, failure: Failure, now_s: float) -> None:
        try:
            self.run_now(run, incident_id, failure, now_s)
        except Exception as exc:
            log.exception("run %s: recovery from incident %d failed", run, incident_id)
            self.core.store.update_run(run, self.core.clock(), state=RunState.FAILED)
            self.core.tracing.trace(self.core.store, incident_id, ended_s=self.core.clock(), error=str(exc))

    def take_up(self, run: RunRow, now_s: float, why: str) -> int:
        """A controller takes up a run its predecessor left unfinished: the recovery under way goes on, or, when
        none was, one is recorded as a ``controller_restart`` incident (``why``) and carried out. Returns the
        incident; the recovery runs on its thread."""
        store = self.core.store
        store.update_run(run.id, now_s, state=RunState.RECOVERING)
        incident = unfinished_incident(store, run.id)
        if incident is None:
            failure = Failure(FailureKind.CONTROLLER_RESTART, "", None, why)
            incident_id, new = store.open_incident(
                key=failure_key(run.id, int(run.generation)),
                run=run.id,
                kind=failure.kind.value,
                node="",
                rank=None,
                detail=failure.detail,
                failed_s=float(run.updated_s),  # the last thing the old controller wrote
                detected_s=now_s,
            )
            if new:
                self.core.tracing.assign(store, incident_id)
        else:
            incident_id, failure = int(incident.id), failure_of(incident)
        log.warning(
            "run %s: taken up (was %s, generation %d); recovery of incident %d (%s) goes on",
            run.id,
            run.state,
            run.generation,
            incident_id,
            failure.kind.value,
        )
        self.start(run.id, incident_id, failure, now_s)
        return incident_id

    def launch_first(self, run: str, now_s: float) -> Launched:
        """The run's first launch (generation 1) on its active nodes: not part of any incident."""
        return self._launch(run, 1, f"{run}-launch-1", now_s)

    # -- carrying out ------------------------------------------------------------------------------------------
    def run_now(self, run: str, incident_id: int, failure: Failure, now_s: float) -> None:
        """Carry out the recovery of ``run`` from ``failure`` (incident ``incident_id``) here: each step recorded
        before it is done, the ones done before skipped."""
        store = self.core.store
        row = store.run(run)
        if row is None:
            raise StepFailedError(f"run {run!r} is not in the state store")
        at_step = self.core.checkpoint_step_ahead(run) if failure.kind is FailureKind.MANUAL_RESTART else None
        generation = row.generation
        incident = store.incident(incident_id)
        group = incident.replica_group if incident is not None else None
        steps = plan_recovery(
            failure, incident_id=incident_id, generation=generation, checkpoint_at_step=at_step, group=group
        )
        seq = -1
        while seq + 1 < len(steps):
            seq += 1
            step = steps[seq]
            try:
                _, result = self._step(run, incident_id, failure, seq, step, now_s)
            except WaitForSpare:
                self._stop_to_wait(run, incident_id, failure, steps, seq, now_s)
                return  # the detection pass goes on once a node is uncordoned or added
            quarantine = result.quarantine if isinstance(result, Dumped) else None
            if quarantine is not None:  # the dumps blamed a node that hung before: the rest of the plan swaps it
                why = Quarantine(quarantine.node, quarantine.reason)
                steps = plan_recovery(
                    failure,
                    incident_id=incident_id,
                    generation=generation,
                    checkpoint_at_step=at_step,
                    quarantine=why,
                    group=group,
                )

    def _step(
        self, run: str, incident_id: int, failure: Failure, seq: int, step: Step, now_s: float
    ) -> tuple[Action, Result]:
        """Step ``seq`` of the plan: recorded under its request id, then carried out and recorded done (skipped when
        a record says it was done); the action and its result."""
        store = self.core.store
        action = store.record_action(
            request_id(incident_id, seq, step.kind),
            run=run,
            incident_id=incident_id,
            seq=seq,
            kind=step.kind,
            args=step_args(step),
            now_s=now_s,
        )
        self._passed(RECORDED, action)
        if action.state == ActionState.DONE:
            done = action.outcome
            return action, done if done is not None else result_of(action.kind, {})
        result = self._carry_out(run, incident_id, failure, action)
        self._passed(CARRIED_OUT, action)
        store.complete_action(action.request_id, self.core.clock(), result_record(result))
        self._passed(COMPLETED, action)
        return action, result

    def _stop_to_wait(
        self, run: str, incident_id: int, failure: Failure, steps: list[Step], seq: int, now_s: float
    ) -> None:
        """No spare for step ``seq``: the plan's ``stop`` is done now, ahead of its turn (under its own request id,
        so that the recovery skips it when it goes on), and the run waits with no rank running: a rank on a failed
        GPU would hang or fail in its next collective, and a waiting run holds no GPUs."""
        stop = next(i for i in range(seq + 1, len(steps)) if isinstance(steps[i], StopStep))
        action, stopped = self._step(run, incident_id, failure, stop, steps[stop], now_s)
        group = action.step.group if isinstance(action.step, StopStep) else None  # as recorded
        if group is not None:  # a replica group: the run goes on with the groups it has, elastically
            self._mark_group(run, group, out=True)
            log.warning("run %s: no spare left; replica group %s stopped, the others train on without it", run, group)
            return
        self.core.store.update_run(run, self.core.clock(), state=RunState.WAITING_FOR_SPARE)
        killed = stopped.killed if isinstance(stopped, Stopped) else "?"
        log.warning("run %s: no spare left; its ranks stopped (%s), it waits for one", run, killed)

    def _mark_group(self, run: str, group: int, *, out: bool) -> None:
        """Record that replica group ``group`` is out of the quorum waiting for a node (or back)."""
        row = self.core.store.run(run)
        if row is None or group not in row.groups:
            return
        groups = {**row.groups, group: replace(row.groups[group], out=out)}
        self.core.store.update_run(run, self.core.clock(), groups=groups)

    def _passed(self, point: str, action: Action) -> None:
        if self.on_step is not None:
            self.on_step(point, action)

    def _carry_out(self, run: str, incident_id: int, failure: Failure, action: Action) -> Result:
        """The step as recorded (a repeat does what the first attempt recorded), carried out; its result."""
        step, rid = action.step, action.request_id
        backend = self._backend()
        match step:
            case CheckpointStep(at_step=at_step):
                return self._checkpoint_now(run, at_step)
            case DumpStep(trigger=trigger):
                ready = self._call(lambda: backend.request_dump(run, trigger, rid), action)
                ranks = ready.ranks if ready.ranks is not None else self.core.running_ranks(run)
                collected = collect_dumps(self.core, run, trigger, ranks, self.core.config.flight_wait_s)
                return self._blame(run, incident_id, collected)
            case StopStep(group=None):
                return self._call(lambda: backend.stop_ranks(run, rid), action)
            case StopStep(group=int(group)):
                failed = self._failed_launch(incident_id)  # a cluster may have relaunched the group since
                stopped = self._call(lambda: backend.stop_ranks(run, rid, group, launch=failed), action)
                self.core.forget_group(run, group, self.core.clock())  # its ranks leave; the others train on
                return stopped
            case CordonStep(node=node, reason=reason):
                done = self._call(lambda: backend.quarantine_node(run, node, reason, rid), action)
                self.core.store.upsert_node(node, self.core.clock(), role=NodeRole.CORDONED, reason=reason)
                return Cordoned(node=node, changed=done.changed)
            case TakeSpareStep(failed=failed):
                return self._take_spare(run, incident_id, failed, action)
            case LaunchStep(after_generation=after, group=None):
                ended = self._stopped_launch(incident_id)  # a repeat launches the same generation: the record's
                return self._launch(run, after + 1, rid, self.core.clock(), ended)
            case LaunchStep(after_generation=after, group=int(group)):
                return self._launch_group(run, group, after + 1, rid, incident_id)
        raise StepFailedError(f"run {run}: unknown recovery step {step!r}")

    def _blame(self, run: str, incident_id: int, collected: Dumped) -> Dumped:
        """What a hang's dumps say of it: the culprit rank they name and its node become the incident's (the first
        guess, the rank furthest behind, is kept in the detail and the result); a node blamed for
        ``hang_quarantine_after`` hangs within ``hang_window_h`` is to be swapped (``quarantine``)."""
        named = culprits(self.core, run, collected.trigger, collected.ranks_expected)
        rank = named[0].rank if named else None
        node = self.core.rank_node(run, rank) if rank is not None else None
        incident = self.core.store.incident(incident_id)
        if rank is None or node is None or incident is None:
            return collected
        first = Blame(rank=incident.rank, node=incident.node)
        if (first.rank, first.node) != (rank, node):
            detail = (
                f"{incident.detail}; the Flight Recorder names rank {rank} on {node} ({named[0].reason});"
                f" first blamed: rank {first.rank} on {first.node}"
            )
            self.core.store.update_incident(incident_id, node=node, rank=rank, detail=detail[:4000])
            log.warning(
                "run %s: incident %d: the dumps blame rank %d on %s, not rank %s on %s",
                run,
                incident_id,
                rank,
                node,
                first.rank,
                first.node,
            )
        config = self.core.config
        window_s = config.hang_window_h * 3600.0
        hangs = [(i.node, float(i.detected_s)) for i in self.core.store.incidents() if i.kind in HANG_KINDS]
        strikes = hang_strikes(node, hangs, float(incident.detected_s), window_s)
        quarantine = None
        if quarantine_after_hangs(strikes, config.hang_quarantine_after):
            reason = f"its ranks hung {strikes} times within {config.hang_window_h:g} h (the Flight Recorder's culprit)"
            quarantine = Swap(node=node, reason=reason)
        culprit = Culprit(rank=rank, node=node, first_blamed=first)
        return structs.replace(collected, culprit=culprit, strikes=strikes, quarantine=quarantine)

    def _take_spare(self, run: str, incident_id: int, failed: str, action: Action) -> SpareTaken:
        """The incident's spare: the one chosen before (a repeat) or a new one, written to the incident before the
        node becomes active, so that a repeat never takes a second."""
        store = self.core.store
        incident = store.incident(incident_id)
        chosen = (incident.spare if incident is not None else None) or choose_spare(self.core, run, failed)
        if chosen is None:
            if incident is not None and incident.replica_group is not None:
                raise WaitForSpare  # a replica group waits out of the quorum: the others train on
            row = store.run(run)
            spec = row.spec if row is not None else RunSpec()
            left = len(store.node_names(run, NodeRole.ACTIVE))
            if shrinks_without_spare(spec.on_no_spare, left, spec.min_nodes):
                log.warning("run %s: no spare left; going on with %d nodes", run, left)
                return SpareTaken(spare=None, shrunk_to_nodes=left)
            raise WaitForSpare
        store.update_incident(incident_id, spare=chosen)
        self._call(lambda: self._backend().promote_spare(run, str(chosen), failed, action.request_id), action)
        store.upsert_node(chosen, self.core.clock(), role=NodeRole.ACTIVE, run=run)  # a pool spare: the run's now
        log.info("run %s: %s replaces %s", run, chosen, failed)
        return SpareTaken(spare=chosen)

    def _failed_launch(self, incident_id: int) -> int | None:
        """The launch the incident's failure was seen in, as its key says (a replica group's: the group's launch)."""
        launch = generation_of(row.key) if (row := self.core.store.incident(incident_id)) is not None else -1
        return launch if launch >= 0 else None

    def _stopped_launch(self, incident_id: int) -> int | list[int] | None:
        """The launch the incident's ``stop`` stopped, as its record says (when the backend named it): one for the
        whole job, or one per replica group (``launches``) where the backend launches the groups apart."""
        stops = [a for a in self.core.store.actions(incident_id=incident_id) if a.kind == ActionKind.STOP]
        stopped = stops[-1].outcome if stops else None
        if not isinstance(stopped, Stopped):
            return None
        return list(stopped.launches) if stopped.launches is not None else stopped.launch

    def _launch(
        self, run: str, generation: int, rid: str, now_s: float, stopped: int | list[int] | None = None
    ) -> Launched:
        """Launch ``generation`` on the run's active nodes: the controller forgets the old launch's ranks (the
        launch ``stopped``, when the record of the stop names it), the backend starts the new one, the run is
        running again. A fault-tolerant run's groups are all launched: each at the launch and on the nodes the
        backend names for it (``launches``, ``group_nodes``: a cluster numbers and places each group's pods), else
        at the run's launch, the nodes split in order."""
        store = self.core.store
        nodes = sorted(store.node_names(run, NodeRole.ACTIVE))
        self.core.forget_ranks(run, now_s, stopped)
        backend = self._backend()
        done = self._call(lambda: backend.relaunch(run, generation, nodes, rid), None)
        launch = done.launch
        self.core.launched(run, self.core.clock(), launch, done.launches)
        row = store.run(run)
        fields: dict[str, object] = {"generation": generation}
        if row is not None and row.spec.replicas.fault_tolerant:
            fields["groups"] = group_launches(row.spec, generation if launch is None else launch, nodes, done)
        if row is None or not RunState(row.state).finished:  # else it ran to its end before this controller looked
            fields["state"] = RunState.RUNNING  # detection watches
        store.update_run(run, self.core.clock(), **fields)
        log.info("run %s: generation %d launched on %s", run, generation, ", ".join(done.nodes or nodes))
        return structs.replace(done, generation=generation, nodes=done.nodes or nodes)

    def _launch_group(self, run: str, group: int, generation: int, rid: str, incident_id: int) -> Launched:
        """Launch replica group ``group`` again, as ``generation``, on its nodes still in service and the spare its
        incident took: the other groups train on, and it heals from them (no checkpoint is read)."""
        store = self.core.store
        row = store.run(run)
        if row is None or group not in row.groups:
            raise StepFailedError(f"run {run!r} has no replica group {group}")
        active = store.node_names(run, NodeRole.ACTIVE)
        nodes = [n for n in row.groups[group].nodes if n in active]
        incident = store.incident(incident_id)
        if incident is not None and incident.spare and incident.spare not in nodes:
            nodes.append(incident.spare)
        backend = self._backend()
        ended = self._stopped_launch(incident_id)  # the group's launch its stop ended
        stopped = ended if isinstance(ended, int) else None
        done = self._call(lambda: backend.relaunch(run, generation, nodes, rid, group, stopped), None)
        launch = done.launch
        self.core.group_launched(run, group, launch)
        row = store.run(run)
        assert row is not None
        if done.nodes:  # where a cluster's scheduler put the group's pods, when the backend says
            nodes = list(done.nodes)
        groups = {**row.groups, group: GroupLaunch(generation if launch is None else launch, tuple(nodes))}
        store.update_run(run, self.core.clock(), generation=max(generation, row.generation), groups=groups)
        log.info("run %s: replica group %d launched again (%d) on %s", run, group, generation, ", ".join(nodes))
        return structs.replace(done, generation=generation, nodes=nodes, group=group)

    def _checkpoint_now(self, run: str, at_step: int | None) -> CheckpointTaken:
        """Ask the ranks for a checkpoint at ``at_step`` and wait until it is committed, a rank ends, or
        ``restart_checkpoint_wait_s`` passes; what happened, for the action's result."""
        row = self.core.store.run(run)
        url = row.spec.checkpoint_url if row is not None else ""
        if at_step is None or not url:
            why = "no checkpoint store" if not url else "the ranks were not progressing"
            return CheckpointTaken(checkpoint_step=None, why=why)
        self.core.ask_checkpoint(run, at_step)
        start = time.monotonic()
        deadline = start + self.core.config.restart_checkpoint_wait_s
        try:
            while time.monotonic() < deadline:
                newest = newest_checkpoint(url) or 0
                if newest >= at_step:
                    waited_s = time.monotonic() - start
                    return CheckpointTaken(checkpoint_step=newest, asked_step=at_step, waited_s=waited_s)
                if self.core.ranks_ended(run):
                    return CheckpointTaken(checkpoint_step=None, asked_step=at_step, why="a rank ended meanwhile")
                self.sleep(0.5)
        finally:
            self.core.ask_checkpoint(run, None)
        return CheckpointTaken(checkpoint_step=None, asked_step=at_step, why="not committed in time")


def group_launches(spec: RunSpec, launch: int, nodes: list[str], done: Launched) -> dict[int, GroupLaunch]:
    """Every replica group of a whole launch: at the launch and on the nodes the relaunch's result ``done`` names
    for it (``launches``, ``group_nodes``), else at ``launch`` on ``nodes`` split in order."""
    groups = spec.replicas.groups
    launches, placed = done.launches, done.group_nodes
    k = len(nodes) // groups
    out = {}
    for g in range(groups):
        at = launches[g] if launches is not None and g < len(launches) else launch
        where = placed[g] if placed is not None and g < len(placed) else nodes[g * k : (g + 1) * k]
        out[g] = GroupLaunch(at, tuple(str(n) for n in where))
    return out
