"""Time in every collective, attributed to the parallel dimension of its process group.

The tracer wraps the two Python entry points through which PyTorch's parallelisms issue collectives:

- ``torch.distributed`` functions (FSDP2's ``all_gather_single`` / ``reduce_scatter_single``, DDP, pipelining's
  ``isend`` / ``irecv``, plain ``all_reduce``, ``all_to_all_single``, ...). A synchronous call is exposed for its
  whole duration. An asynchronous one returns a :class:`TimedWork` (a real ``dist.Work`` subclass, so the callers'
  ``isinstance`` checks still hold): its completion time comes from the work's future, which the backend completes
  when the collective finishes, and the time spent in ``wait()`` is the exposed part.
- functional collectives (``torch.ops._c10d_functional``: DTensor / tensor parallel, and any code using
  ``torch.distributed._functional_collectives``, including their autograd backward): issue is timed when the op is
  called, completion and exposure by its ``wait_tensor``.

Phases: each collective is counted, when issued, under the phase of training it serves: the phase the trainer
marked (``with tracer.phase("optimizer"):``; a mark wins), else ``backward`` while autograd runs a backward pass
(``torch._C._current_graph_task_id() != -1``: FSDP2's and tensor parallel's backward hooks, activation
recomputation, on whichever thread the engine runs them), else ``forward`` inside a step and ``other`` outside
one. A pipeline schedule sends and receives outside autograd; on a ``pp`` group their direction tells: a send to a
later stage and a receive from an earlier one carry activations (``forward``), the other two gradients
(``backward``). That is exact for GPipe and 1F1B; an interleaved schedule's wrap-around from the last rank to the
first counts as backward. A schedule also runs FSDP's gradient reduction itself, outside autograd
(``perform_reduce_grad``): it is marked ``backward``.

Durations: on a process group whose backend has an on-completion hook (NCCL), the hook gives each collective's duration
as measured on the GPU by CUDA events. NCCL accepts the hook only when ``TORCH_NCCL_ENABLE_TIMING=1`` was set before
the process group was created (else ``ValueError``): a group whose hook cannot be registered is timed on the host
instead, and counted (``timing_fallbacks``). The hook runs on NCCL's watchdog thread once the work is done on the GPU,
often after the step that issued it has ended: its duration goes to the step and phase that issued the work (the
``StepComms`` of that step, whose ``gpu_pending`` counts the durations still to come). NCCL launches the sends and
receives of a ``batch_isend_irecv`` (a pipeline's step) as one work, whose hook fires once with the op ``COALESCED``:
the batch's transfers share its duration, which is also the stage's wait (its bubble), once. Elsewhere (gloo) durations
are measured on the host from issue to completion of the work. Time that did not block the training thread is
"overlapped"; per step, compute time = step time - exposed time.

Host cost: a traced call does its bookkeeping in one locked update, with the group's name, dimension and timing
looked up once per group (``bench.hook_overhead`` prints the cost of a call). The tracer never raises into training:
its own failures are counted (``internal_errors``) and logged once.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from trainer_hooks.comm_tables import (
    BACKWARD,
    DIMENSIONS,
    FORWARD,
    OTHER,
    PHASES,
    PIPELINE_DIMENSION,
    PIPELINE_OPS,
    Blocked,
    GroupInfo,
    Key,
    OpStats,
    StepComms,
    add_batch_duration,
    is_pipeline_transfer,
    op_label,
)
from trainer_hooks.tracer_install import Installer
from trainer_hooks.works import (
    TimedWork,
    completion_seconds,
    group_name,
)

log = logging.getLogger(__name__)

_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)  # -1: no backward pass running
_perf_counter = time.perf_counter
# issued works awaiting their completion hook, per (group, op): bounded (a hook may never fire)
_MAX_GPU_PENDING = 1024


_NO_GROUP = GroupInfo("", OTHER, False)  # no default group (torch.distributed not initialised)


class PhaseMark:
    """``with tracer.phase(name):`` the collectives issued inside are counted under phase ``name`` (nests)."""

    __slots__ = ("_phase", "_previous", "_tracer")

    def __init__(self, tracer: CollectiveTracer, phase: str) -> None:
        self._tracer = tracer
        self._phase = phase
        self._previous: str | None = None

    def __enter__(self) -> None:
        self._previous = self._tracer.marked_phase
        self._tracer.marked_phase = self._phase

    def __exit__(self, *exc: object) -> None:
        self._tracer.marked_phase = self._previous


class CollectiveTracer(Installer):
    """Process-wide tracer of collectives; ``install()`` once, label groups, read ``take_step()`` per step."""

    def __init__(self) -> None:
        self._labels: dict[str, str] = {}
        self._groups: dict[str, GroupInfo] = {}  # by group name, derived from the labels and the hooks registered
        self._lock = threading.Lock()
        self._step = StepComms()
        self._pending: dict[int, tuple[Key, float, bool]] = {}  # functional ops issued, by their output's data
        self._originals: dict[tuple[Any, str], Any] = {}
        self._gpu_timed: set[str] = set()  # groups whose completion hook reports durations
        self._fallen_back: set[str] = set()  # groups whose hook could not be registered: timed on the host
        self._inflight: list[TimedWork] = []
        self._blocked: tuple[Key, float] | None = None  # what the training thread waits on, since when
        # (group, op) -> (the step that issued it, its phase) of each work awaiting its completion hook
        self._gpu_issued: dict[tuple[str, str], deque[tuple[StepComms, str]]] = {}
        # group -> the point-to-point batches (``batch_isend_irecv``) awaiting their one completion (NCCL's op
        # ``COALESCED``): the step that issued each, and its transfers' keys
        self._gpu_batches: dict[str, deque[tuple[StepComms, list[Key]]]] = {}
        self._batching: tuple[str, list[Key]] | None = None  # the batch being issued (on the training thread)
        self._peers: dict[str, dict[int, int]] = {}  # pp group -> global rank -> rank in the group
        self.marked_phase: str | None = None  # set by ``phase()``
        self.default_phase = OTHER  # the phase of collectives neither marked nor in backward (the monitor's step)
        self.internal_errors = 0
        self.gpu_durations_lost = 0  # issued works whose completion hook never came (dropped past the bound)
        self._warned = False
        self._warned_fallback = False

    # -- phases ------------------------------------------------------------------------------------------------
    def phase(self, name: str) -> PhaseMark:
        """Count the collectives issued inside ``with tracer.phase(name):`` under ``name`` (one of ``PHASES``),
        whatever autograd is doing. An unknown name is counted as an internal error and marks ``other``."""
        if name not in PHASES:
            self._internal_error(ValueError(f"collectives: unknown phase {name!r}; known: {', '.join(PHASES)}"))
            name = OTHER
        return PhaseMark(self, name)

    def _mark(self, phase: str) -> PhaseMark:
        return PhaseMark(self, phase)

    def current_phase(self) -> str:
        """The phase a collective issued now is counted under."""
        marked = self.marked_phase
        if marked is not None:
            return marked
        if _graph_task_id() != -1:
            return BACKWARD
        return self.default_phase

    def _p2p_phase(self, group: Any, op: str, peer: Any, group_peer: Any) -> str | None:
        """The phase of a pipeline send or receive from its direction: with a later stage, a send is forward
        traffic (activations) and a receive backward (gradients); the other way round with an earlier one. None
        when it cannot tell (or the trainer marked the phase)."""
        if self.marked_phase is not None or not isinstance(group, dist.ProcessGroup):
            return None
        other = group_peer
        if not isinstance(other, int):
            if not isinstance(peer, int):
                return None
            ranks = self._peers.get(group.group_name)
            if ranks is None:
                ranks = self._peers[group.group_name] = {
                    r: i for i, r in enumerate(dist.get_process_group_ranks(group))
                }
            other = ranks.get(peer)
        me = group.rank()
        if other is None or other == me or me < 0:
            return None
        return FORWARD if (other > me) == (op == "send") else BACKWARD

    # -- labelling -------------------------------------------------------------------------------------------
    @property
    def timing_fallbacks(self) -> int:
        """Process groups whose backend has a completion hook that refused it (NCCL without
        ``TORCH_NCCL_ENABLE_TIMING=1``, or anything else that failed): their collectives are timed on the host."""
        return len(self._fallen_back)

    def label(self, group: dist.ProcessGroup, dimension: str) -> None:
        """Attribute the collectives of ``group`` to ``dimension`` (the last label of a group wins). On a backend
        with an on-completion hook (NCCL) durations come from that hook from now on; when registering it fails, the
        group is timed on the host and counted (``timing_fallbacks``), never raised."""
        if dimension not in DIMENSIONS:
            raise ValueError(f"collectives: unknown dimension {dimension!r}; known: {', '.join(DIMENSIONS)}")
        name = group.group_name
        self._labels[name] = dimension
        if name not in self._gpu_timed and name not in self._fallen_back:
            try:
                group._register_on_completion_hook(  # type: ignore[attr-defined]
                    functools.partial(self._on_completion, name)
                )
                self._gpu_timed.add(name)
            except AttributeError:
                pass  # no such call: host-timed
            except Exception as exc:
                # A backend without the hook fails c10d's TORCH_CHECK: exactly RuntimeError. NCCL raises ValueError
                # without TORCH_NCCL_ENABLE_TIMING=1, DistBackendError (a RuntimeError subclass) when a hook is
                # already registered; those, and anything else, are a fallback.
                if type(exc) is not RuntimeError:
                    self._fall_back(name, exc)
        self._groups[name] = GroupInfo(name, dimension, name in self._gpu_timed, name in self._fallen_back)

    def _fall_back(self, name: str, exc: BaseException) -> None:
        self._fallen_back.add(name)
        if not self._warned_fallback:
            self._warned_fallback = True
            log.warning(
                "collectives of process group %s are timed on the host: its completion hook was refused (%r); on "
                "NCCL, set TORCH_NCCL_ENABLE_TIMING=1 before creating the process group (counted, not raised)",
                name,
                exc,
            )

    def block(self, key: Key | None) -> None:
        """The training thread waits on the collective ``key`` from now (None: no longer; ``blocked()`` tells)."""
        self._blocked = None if key is None else (key, _perf_counter())

    def blocked(self) -> Blocked | None:
        """What the training thread is waiting on now; None if nothing. Read from any thread (the watchdog)."""
        current = self._blocked
        if current is None:
            return None
        (dim, op, _), since = current
        return Blocked(dim, op, since, time.perf_counter() - since)

    def host_timed(self, group: dist.ProcessGroup | str | None) -> bool:
        """Whether this tracer times ``group``'s collectives on the host (no completion hook)."""
        return not self._group(group).gpu_timed

    def _group(self, group: dist.ProcessGroup | str | None) -> GroupInfo:
        """What the tracer knows of ``group`` (None: the default group)."""
        name = group if isinstance(group, str) else group_name(group)
        if name is None:
            return _NO_GROUP
        found = self._groups.get(name)
        if found is None:
            found = self._groups[name] = GroupInfo(
                name, self._labels.get(name, OTHER), name in self._gpu_timed, name in self._fallen_back
            )
        return found

    def _on_completion(self, group_name: str, info: Any) -> None:
        """The completion hook (on the backend's watchdog thread): adds the work's duration to the step that issued
        it, under its phase: that of the oldest work of the same op issued on the group and not completed yet (works
        of one op on one group complete in order). A work the tracer did not see issued counts in the current step,
        as ``other``."""
        try:
            op = op_label(info.op_type)
            seconds = completion_seconds(info)
            dim = self._labels.get(group_name, OTHER)
            with self._lock:
                issued = self._gpu_issued.get((group_name, op))
                batch = self._completed_batch(group_name, info.op_type, op, bool(issued))
                if batch is not None:
                    add_batch_duration(*batch, seconds)
                    return
                seen = bool(issued)  # issued through the tracer: one of its step's durations to come
                step, phase = issued.popleft() if issued else (self._step, OTHER)
                key = (dim, op, phase)
                stats = step.phases.get(key)
                if stats is None:
                    stats = step.phases[key] = OpStats()
                stats.seconds += seconds
                if is_pipeline_transfer(key):  # on the GPU a transfer's kernel runs until its peer's side arrives
                    step.pipeline_wait_s += seconds
                if seen and step.gpu_pending > 0:  # not for a work it never saw (DDP's reducer, c10d's own)
                    step.gpu_pending -= 1
        except Exception as exc:
            self._internal_error(exc)

    def _completed_batch(
        self, group_name: str, op_type: Any, op: str, issued: bool
    ) -> tuple[StepComms, list[Key]] | None:
        """The batch a completion ends (under the lock): the group's oldest, for a ``COALESCED`` one; for a send or
        receive that was not issued alone, a batch of that one transfer. None: not a batch's."""
        batches = self._gpu_batches.get(group_name)
        if not batches:
            return None
        coalesced = getattr(op_type, "name", str(op_type)).rsplit(".", 1)[-1] == "COALESCED"
        keys = batches[0][1]
        if coalesced or (not issued and len(keys) == 1 and keys[0][1] == op):
            return batches.popleft()
        return None

    def begin_batch(self, group: dist.ProcessGroup | None) -> bool:
        """The point-to-point ops issued until ``end_batch`` are one batch, which completes once (on a group whose
        durations come from its completion hook; elsewhere nothing changes: False)."""
        g = self._group(group)
        if not g.gpu_timed:
            return False
        with self._lock:
            self._batching = (g.name, [])
        return True

    def end_batch(self) -> None:
        with self._lock:
            batching, self._batching = self._batching, None
            if batching is None or not batching[1]:
                return
            name, keys = batching
            batches = self._gpu_batches.get(name)
            if batches is None:
                batches = self._gpu_batches[name] = deque()
            if len(batches) >= _MAX_GPU_PENDING:  # a hook that never fired: that batch's duration is lost
                lost, lost_keys = batches.popleft()
                lost.gpu_pending = max(lost.gpu_pending - len(lost_keys), 0)
                self.gpu_durations_lost += len(lost_keys)
            batches.append((self._step, keys))

    def dimension_of(self, group: dist.ProcessGroup | str | None) -> str:
        """The label of ``group`` (None: the default group), ``other`` when it has none."""
        return self._group(group).dim

    # -- accounting ------------------------------------------------------------------------------------------
    def _issue(self, group: dist.ProcessGroup | str | None, op: str, nbytes: int, phase: str | None = None) -> Key:
        """Count a collective issued now on ``group`` (in the current phase unless ``phase`` says); its key."""
        g = self._group(group)
        key = (g.dim, op, phase or self.current_phase())
        self._count(key, nbytes, g)
        return key

    def _count(self, key: Key, nbytes: int, g: GroupInfo, seconds: float = 0.0, exposed_s: float = 0.0) -> None:
        """One locked update of the current step: a collective issued on ``g``, and, for one that already completed
        on the host, its duration and the time the training thread waited on it."""
        with self._lock:
            step = self._step
            stats = step.phases.get(key)
            if stats is None:
                stats = step.phases[key] = OpStats()
            stats.count += 1
            stats.bytes += nbytes
            if g.fell_back:
                stats.host_timed = True
            pipeline = key[0] == PIPELINE_DIMENSION and key[1] in PIPELINE_OPS
            if pipeline:
                step.pipeline_transfers += 1
            if seconds:
                stats.seconds += seconds
            if exposed_s:
                step.exposed_s += exposed_s
                if pipeline:
                    step.pipeline_wait_s += exposed_s
            if g.gpu_timed and self._batching is not None and self._batching[0] == g.name:
                self._batching[1].append(key)  # one of a batch: its duration comes with the batch's
                step.gpu_pending += 1
            elif g.gpu_timed:
                issued = self._gpu_issued.get((g.name, key[1]))
                if issued is None:
                    issued = self._gpu_issued[(g.name, key[1])] = deque()
                if len(issued) >= _MAX_GPU_PENDING:  # a hook that never fired: that work's duration is lost
                    lost, _ = issued.popleft()
                    lost.gpu_pending = max(lost.gpu_pending - 1, 0)
                    self.gpu_durations_lost += 1
                issued.append((step, key[2]))
                step.gpu_pending += 1

    def record(self, dimension: str, op: str, nbytes: int, seconds: float) -> None:
        """A collective issued outside ``torch.distributed``'s functions and waited for by its caller, who timed it
        (torchft's process group across replica groups): counted under ``dimension`` (``other`` when unknown) and
        the current phase, its time exposed. Never raises."""
        try:
            key = (dimension if dimension in DIMENSIONS else OTHER, op, self.current_phase())
            nbytes, seconds = int(nbytes), float(seconds)
            with self._lock:
                stats = self._step.phases.setdefault(key, OpStats())
                stats.count += 1
                stats.bytes += nbytes
                stats.seconds += seconds
                self._step.exposed_s += seconds
        except Exception as exc:
            self._internal_error(exc)

    def add_duration(self, key: Key, seconds: float) -> None:
        with self._lock:
            self._step.phases.setdefault(key, OpStats()).seconds += seconds

    def add_exposed(self, seconds: float, key: Key | None = None) -> None:
        """The training thread waited ``seconds`` on the collective ``key`` (None: not known, or timed elsewhere);
        a wait on a pipeline send or receive is also the stage's bubble."""
        with self._lock:
            self._step.exposed_s += seconds
            if is_pipeline_transfer(key):
                self._step.pipeline_wait_s += seconds

    def waited(self, key: Key, exposed_s: float, seconds: float | None) -> None:
        """The training thread waited ``exposed_s`` on the host-timed collective ``key``, which took ``seconds``
        from issue to completion (None: its duration was taken before, or comes from elsewhere)."""
        with self._lock:
            step = self._step
            step.exposed_s += exposed_s
            if key[0] == PIPELINE_DIMENSION and key[1] in PIPELINE_OPS:
                step.pipeline_wait_s += exposed_s
            if seconds is not None:
                stats = step.phases.get(key)
                if stats is None:
                    stats = step.phases[key] = OpStats()
                stats.seconds += seconds

    def add_pipeline_wait(self, seconds: float) -> None:
        with self._lock:
            self._step.pipeline_wait_s += seconds

    def track(self, work: TimedWork) -> None:
        with self._lock:
            self._inflight.append(work)

    def poll(self) -> None:
        """Finish the works in flight that have completed (called at every traced call and each step's end)."""
        if not self._inflight:
            return
        now = time.perf_counter()
        with self._lock:
            inflight, self._inflight = self._inflight, []
        still = [work for work in inflight if not work.poll(now)]
        if still:
            with self._lock:
                self._inflight.extend(still)

    def take_step(self) -> StepComms:
        """The collectives since the last call. A host-timed collective still in flight adds its time to the next
        step; a GPU-timed one adds it to this step when its completion hook fires (``gpu_pending`` counts them)."""
        self.poll()
        with self._lock:
            step, self._step = self._step, StepComms()
        return step

    def _internal_error(self, exc: BaseException) -> None:
        self.internal_errors += 1
        if not self._warned:
            self._warned = True
            log.warning("collective tracing failed (counted, not raised): %r", exc)


#: The process-wide tracer (collectives are process-wide: one tracer per process).
TRACER = CollectiveTracer()
