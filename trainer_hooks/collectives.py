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

Durations are measured on the host from issue to completion: on CPU (gloo) that is the collective's time. Time
that did not block the training thread is "overlapped"; per step, compute time = step time - exposed time.

The tracer never raises into training: its own failures are counted (``internal_errors``) and logged once.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

log = logging.getLogger(__name__)

OTHER = "other"
DIMENSIONS = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", OTHER)

# torch.distributed function -> (op label, the argument whose bytes count, always asynchronous)
_DIST_FUNCTIONS: dict[str, tuple[str, str, bool]] = {
    "all_reduce": ("all_reduce", "tensor", False),
    "all_gather_single": ("all_gather", "output_tensor", False),
    "all_gather_into_tensor": ("all_gather", "output_tensor", False),
    "all_gather": ("all_gather", "tensor_list", False),
    "reduce_scatter_single": ("reduce_scatter", "input", False),
    "reduce_scatter_tensor": ("reduce_scatter", "input", False),
    "all_to_all_single": ("all_to_all", "input", False),
    "broadcast": ("broadcast", "tensor", False),
    "send": ("send", "tensor", False),
    "recv": ("recv", "tensor", False),
    "isend": ("send", "tensor", True),
    "irecv": ("recv", "tensor", True),
}
# ``P2POp`` and ``batch_isend_irecv`` compare ``op`` with these by identity, against the names in
# ``distributed_c10d``: they are replaced there as well as in ``torch.distributed``.
_IDENTITY_CHECKED = ("isend", "irecv")
# functional op -> (op label, index of the tensor argument, index of the group-name argument)
_FUNCTIONAL_OPS: dict[str, tuple[str, int, int]] = {
    "all_reduce": ("all_reduce", 0, 2),
    "all_gather_into_tensor": ("all_gather", 0, 2),
    "reduce_scatter_tensor": ("reduce_scatter", 0, 3),
    "all_to_all_single": ("all_to_all", 0, 3),
    "broadcast": ("broadcast", 0, 2),
}


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_nbytes(v) for v in value)
    return 0


@dataclass
class OpStats:
    count: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class StepComms:
    """Collectives of one step: per (dimension, op) counts, bytes and issue-to-completion seconds; exposed seconds."""

    ops: dict[tuple[str, str], OpStats] = field(default_factory=dict)
    exposed_s: float = 0.0

    @property
    def total_s(self) -> float:
        return sum(s.seconds for s in self.ops.values())

    def by_dimension(self) -> dict[str, OpStats]:
        out: dict[str, OpStats] = {}
        for (dim, _), s in self.ops.items():
            acc = out.setdefault(dim, OpStats())
            acc.count += s.count
            acc.bytes += s.bytes
            acc.seconds += s.seconds
        return out


class TimedWork(dist.Work):
    """A ``dist.Work`` that reports when it is waited on and when it completes."""

    def __init__(self, inner: dist.Work, tracer: CollectiveTracer, key: tuple[str, str], issued: float) -> None:
        super().__init__()
        self._inner = inner
        self._tracer = tracer
        self._key = key
        self._issued = issued
        self._done = False
        self._lock = threading.Lock()
        # Some backends give no future for some ops: completion is then seen at wait().
        with contextlib.suppress(Exception):
            inner.get_future().then(self._on_complete)

    def _finish(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        self._tracer._add_duration(self._key, time.perf_counter() - self._issued)

    def _on_complete(self, fut: torch.futures.Future[Any]) -> None:
        self._finish()

    def wait(self, timeout: Any = None) -> bool:
        start = time.perf_counter()
        result = self._inner.wait() if timeout is None else self._inner.wait(timeout)
        self._tracer._add_exposed(time.perf_counter() - start)
        self._finish()
        return bool(result)

    def is_completed(self) -> bool:
        return bool(self._inner.is_completed())

    def is_success(self) -> bool:
        return bool(self._inner.is_success())

    def exception(self) -> Any:
        return self._inner.exception()

    def source_rank(self) -> int:
        return int(self._inner.source_rank())

    def result(self) -> list[torch.Tensor]:
        return list(self._inner.result())

    def synchronize(self) -> None:
        self._inner.synchronize()

    def get_future(self) -> torch.futures.Future[Any]:
        return self._inner.get_future()


class _FunctionalOp:
    """Stands in for a ``torch.ops._c10d_functional`` packet: times the call, delegates everything else."""

    def __init__(self, packet: Any, call: Callable[..., Any]) -> None:
        self._packet = packet
        self._call = call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._packet, name)


class CollectiveTracer:
    """Process-wide tracer of collectives; ``install()`` once, label groups, read ``take_step()`` per step."""

    def __init__(self) -> None:
        self._labels: dict[str, str] = {}
        self._lock = threading.Lock()
        self._step = StepComms()
        self._pending: dict[int, tuple[tuple[str, str], float]] = {}
        self._originals: dict[tuple[Any, str], Any] = {}
        self.internal_errors = 0
        self._warned = False

    # -- labelling -------------------------------------------------------------------------------------------
    def label(self, group: dist.ProcessGroup, dimension: str) -> None:
        """Attribute the collectives of ``group`` to ``dimension`` (the last label of a group wins)."""
        if dimension not in DIMENSIONS:
            raise ValueError(f"collectives: unknown dimension {dimension!r}; known: {', '.join(DIMENSIONS)}")
        self._labels[group.group_name] = dimension

    def dimension_of(self, group: dist.ProcessGroup | str | None) -> str:
        if group is None:
            return OTHER
        name = group if isinstance(group, str) else group.group_name
        return self._labels.get(name, OTHER)

    # -- accounting ------------------------------------------------------------------------------------------
    def _issue(self, dim: str, op: str, nbytes: int) -> tuple[str, str]:
        key = (dim, op)
        with self._lock:
            stats = self._step.ops.setdefault(key, OpStats())
            stats.count += 1
            stats.bytes += nbytes
        return key

    def _add_duration(self, key: tuple[str, str], seconds: float) -> None:
        with self._lock:
            self._step.ops.setdefault(key, OpStats()).seconds += seconds

    def _add_exposed(self, seconds: float) -> None:
        with self._lock:
            self._step.exposed_s += seconds

    def take_step(self) -> StepComms:
        """The collectives since the last call (a collective still in flight adds its time to the next step)."""
        with self._lock:
            step, self._step = self._step, StepComms()
        return step

    def _internal_error(self, exc: BaseException) -> None:
        self.internal_errors += 1
        if not self._warned:
            self._warned = True
            log.warning("collective tracing failed (counted, not raised): %r", exc)

    # -- installation ----------------------------------------------------------------------------------------
    @property
    def installed(self) -> bool:
        return bool(self._originals)

    def install(self) -> None:
        if self.installed:
            return
        for name, (op, tensor_arg, always_async) in _DIST_FUNCTIONS.items():
            original = getattr(dist, name, None)
            if original is None:
                continue
            traced = self._wrap_dist(original, op, tensor_arg, always_async)
            self._originals[(dist, name)] = original
            setattr(dist, name, traced)
            if name in _IDENTITY_CHECKED and getattr(c10d, name, None) is original:
                self._originals[(c10d, name)] = original
                setattr(c10d, name, traced)
        namespace = torch.ops._c10d_functional
        for name, (op, tensor_index, group_index) in _FUNCTIONAL_OPS.items():
            packet = getattr(namespace, name)
            self._originals[(namespace, name)] = packet
            traced = self._wrap_functional(packet, op, tensor_index, group_index)
            setattr(namespace, name, _FunctionalOp(packet, traced))
        wait_packet = getattr(namespace, "wait_tensor")  # noqa: B009
        self._originals[(namespace, "wait_tensor")] = wait_packet
        setattr(namespace, "wait_tensor", _FunctionalOp(wait_packet, self._wrap_wait(wait_packet)))  # noqa: B010

    def uninstall(self) -> None:
        for (owner, name), original in self._originals.items():
            setattr(owner, name, original)
        self._originals.clear()

    def _wrap_dist(self, original: Callable[..., Any], op: str, tensor_arg: str, always_async: bool) -> Any:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def traced(*args: Any, **kwargs: Any) -> Any:
            try:
                bound = signature.bind_partial(*args, **kwargs).arguments
                key = self._issue(self.dimension_of(bound.get("group")), op, _nbytes(bound.get(tensor_arg)))
            except Exception as exc:
                self._internal_error(exc)
                return original(*args, **kwargs)
            start = time.perf_counter()
            work = original(*args, **kwargs)
            if work is None or not (always_async or bound.get("async_op")):
                elapsed = time.perf_counter() - start
                self._add_duration(key, elapsed)
                self._add_exposed(elapsed)
                return work
            try:
                return TimedWork(work, self, key, start)
            except Exception as exc:
                self._internal_error(exc)
                return work

        return traced

    def _wrap_functional(self, packet: Any, op: str, tensor_index: int, group_index: int) -> Callable[..., Any]:
        def traced(*args: Any, **kwargs: Any) -> Any:
            out = packet(*args, **kwargs)
            try:
                key = self._issue(self.dimension_of(args[group_index]), op, _nbytes(args[tensor_index]))
                with self._lock:
                    self._pending[id(out)] = (key, time.perf_counter())
            except Exception as exc:
                self._internal_error(exc)
            return out

        return traced

    def _wrap_wait(self, packet: Any) -> Callable[..., Any]:
        def traced(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = packet(tensor, *args, **kwargs)
            end = time.perf_counter()
            try:
                with self._lock:
                    pending = self._pending.pop(id(tensor), None)
                if pending is not None:
                    self._add_exposed(end - start)
                    self._add_duration(pending[0], end - pending[1])
            except Exception as exc:
                self._internal_error(exc)
            return out

        return traced


#: The process-wide tracer (collectives are process-wide: one tracer per process).
TRACER = CollectiveTracer()
