"""What the collective tracer (``trainer_hooks.collectives``) puts between a caller and torch.distributed: the
``TimedWork`` an asynchronous call returns, the stand-in for a functional collective, and how the bytes and the
group of a call are read from its arguments."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from trainer_hooks.comm_tables import Key


class WorkObserver(Protocol):
    """What a ``TimedWork`` tells its tracer."""

    def track(self, work: TimedWork) -> None: ...

    def add_duration(self, key: Key, seconds: float) -> None: ...

    def add_exposed(self, seconds: float, key: Key | None = None) -> None: ...

    def waited(self, key: Key, exposed_s: float, seconds: float | None) -> None: ...

    def block(self, key: Key | None) -> None: ...


def completion_seconds(info: Any) -> float:
    """Duration of a completed work from the on-completion hook's ``WorkInfo``: the GPU-side ``active_duration``
    when timing is enabled, else the host's issue-to-detection time."""
    active = float(info.active_duration.total_seconds())
    if active > 0:
        return active
    return max(float((info.time_finished - info.time_started).total_seconds()), 0.0)


def argument_getter(function: Callable[..., Any], name: str) -> Callable[[tuple[Any, ...], dict[str, Any]], Any]:
    """A fast reader of argument ``name`` of calls to ``function`` (binding the signature per call is slow)."""
    parameter = inspect.signature(function).parameters.get(name)
    if parameter is None:
        return lambda args, kwargs: None
    default = None if parameter.default is inspect.Parameter.empty else parameter.default
    positional = list(inspect.signature(function).parameters).index(name)
    if parameter.kind is inspect.Parameter.KEYWORD_ONLY:
        return lambda args, kwargs: kwargs.get(name, default)
    return lambda args, kwargs: args[positional] if len(args) > positional else kwargs.get(name, default)


def group_name(group: dist.ProcessGroup | str | None) -> str | None:
    if group is None:
        group = dist.group.WORLD if dist.is_initialized() else None
        if group is None:
            return None
    return group if isinstance(group, str) else group.group_name


def buffer_bytes(tensor: Any) -> int:
    """What identifies a functional collective's output when it is waited on: its data's address. In forward,
    autograd hands the wait another tensor object over the same data (``_wrap_tensor_autograd``)."""
    try:
        return int(tensor.data_ptr()) or id(tensor)
    except Exception:
        return id(tensor)


def size_of(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(size_of(v) for v in value)
    return 0


class TimedWork(dist.Work):
    """A ``dist.Work`` that reports when it is waited on and when it is first seen complete.

    Completion is observed on the training thread, never by a callback: a Python callback on the backend's thread
    must take the GIL from the training thread, which held up the backend's next collective (a few percent of
    step time on CPU). The tracer polls the works in flight at every collective call and wait, and at the end of
    each step; a work's duration ends when it is first seen complete, or when its ``wait()`` returns.
    """

    def __init__(
        self,
        inner: dist.Work,
        tracer: WorkObserver,
        key: Key,
        issued: float,
        *,
        host_timed: bool = True,
    ) -> None:
        super().__init__()
        self._inner = inner
        self._tracer = tracer
        self._key = key
        self._issued = issued
        self._host_timed = host_timed
        self.done = not host_timed  # the group's completion hook reports the duration
        if not self.done:
            tracer.track(self)

    def finish(self, now: float) -> None:
        if not self.done:
            self.done = True
            self._tracer.add_duration(self._key, now - self._issued)

    def poll(self, now: float) -> bool:
        """Finish if the work has completed; whether it is done."""
        if not self.done and self._inner.is_completed():
            self.finish(now)
        return self.done

    def wait(self, timeout: Any = None) -> bool:
        tracer = self._tracer
        start = time.perf_counter()
        completed = self.done or self._inner.is_completed()
        if not completed:
            tracer.block(self._key)
        try:
            result = self._inner.wait() if timeout is None else self._inner.wait(timeout)
        finally:
            if not completed:
                tracer.block(None)
        end = time.perf_counter()
        if self._host_timed:
            # the wait is what the training thread lost to the peer (a pipeline stage's bubble); the duration ends
            # when the work was first seen complete
            seconds = None if self.done else (start if completed else end) - self._issued
            self.done = True
            tracer.waited(self._key, end - start, seconds)
        else:
            tracer.add_exposed(end - start)
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


class FunctionalOp:
    """Stands in for a ``torch.ops._c10d_functional`` packet: times the call, delegates everything else."""

    def __init__(self, packet: Any, call: Callable[..., Any]) -> None:
        self._packet = packet
        self._call = call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._packet, name)
