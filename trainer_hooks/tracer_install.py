"""How the collective tracer (``trainer_hooks.collectives``) gets between the callers and torch.distributed: it
replaces the ``torch.distributed`` functions and the functional collectives' ops with traced ones, and marks a
pipeline schedule's gradient reduction as backward. ``Installer`` is the tracer's part that does it; what it calls
of the tracer's bookkeeping is declared here and defined there."""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from trainer_hooks.comm_tables import (
    BACKWARD,
    DIST_FUNCTIONS,
    FUNCTIONAL_GROUP_SIZE_INDEX,
    FUNCTIONAL_OPS,
    IDENTITY_CHECKED,
    PEER_ARGUMENTS,
    PIPELINE_DIMENSION,
    GroupInfo,
    Key,
)
from trainer_hooks.works import FunctionalOp, TimedWork, argument_getter, buffer_bytes, size_of

_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)  # -1: no backward pass running
_perf_counter = time.perf_counter
_MAX_PENDING = 4096  # functional collectives issued and not waited on (through the traced wait) yet


class Installer:
    """The tracer's wrappers of torch.distributed (mixed into ``CollectiveTracer``)."""

    _originals: dict[tuple[Any, str], Any]
    _pending: dict[int, tuple[Key, float, bool]]  # functional ops issued, by their output's data
    _inflight: list[TimedWork]
    _blocked: tuple[Key, float] | None
    marked_phase: str | None
    default_phase: str

    def poll(self) -> None:
        raise NotImplementedError

    def current_phase(self) -> str:
        raise NotImplementedError

    def _group(self, group: dist.ProcessGroup | str | None) -> GroupInfo:
        raise NotImplementedError

    def _p2p_phase(self, group: Any, op: str, peer: Any, group_peer: Any) -> str | None:
        raise NotImplementedError

    def _count(self, key: Key, nbytes: int, g: GroupInfo, seconds: float = 0.0, exposed_s: float = 0.0) -> None:
        raise NotImplementedError

    def add_exposed(self, seconds: float, key: Key | None = None) -> None:
        raise NotImplementedError

    def add_duration(self, key: Key, seconds: float) -> None:
        raise NotImplementedError

    def track(self, work: TimedWork) -> None:
        raise NotImplementedError

    def block(self, key: Key | None) -> None:
        raise NotImplementedError

    def waited(self, key: Key, exposed_s: float, seconds: float | None) -> None:
        raise NotImplementedError

    def _internal_error(self, exc: BaseException) -> None:
        raise NotImplementedError

    def _mark(self, phase: str) -> Any:
        raise NotImplementedError

    def begin_batch(self, group: dist.ProcessGroup | None) -> bool:
        raise NotImplementedError

    def end_batch(self) -> None:
        raise NotImplementedError

    @property
    def installed(self) -> bool:
        return bool(self._originals)

    def install(self) -> None:
        if self.installed:
            return
        for name, (op, tensor_arg, always_async) in DIST_FUNCTIONS.items():
            original = getattr(dist, name, None)
            if original is None:
                continue
            traced = self._wrap_dist(original, op, tensor_arg, always_async)
            self._originals[(dist, name)] = original
            setattr(dist, name, traced)
            if name in IDENTITY_CHECKED and getattr(c10d, name, None) is original:
                self._originals[(c10d, name)] = original
                setattr(c10d, name, traced)
        batch = getattr(dist, "batch_isend_irecv", None)
        if batch is not None:  # a pipeline's sends and receives of a step, launched as one (NCCL: one completion)
            traced_batch = self._wrap_batch(batch)
            self._originals[(dist, "batch_isend_irecv")] = batch
            setattr(dist, "batch_isend_irecv", traced_batch)  # noqa: B010
            if getattr(c10d, "batch_isend_irecv", None) is batch:
                self._originals[(c10d, "batch_isend_irecv")] = batch
                setattr(c10d, "batch_isend_irecv", traced_batch)  # noqa: B010
        namespace = torch.ops._c10d_functional
        for name, (op, tensor_index, group_index) in FUNCTIONAL_OPS.items():
            packet = getattr(namespace, name)
            self._originals[(namespace, name)] = packet
            traced = self._wrap_functional(packet, op, tensor_index, group_index, FUNCTIONAL_GROUP_SIZE_INDEX.get(name))
            setattr(namespace, name, FunctionalOp(packet, traced))
        wait_packet = getattr(namespace, "wait_tensor")  # noqa: B009
        self._originals[(namespace, "wait_tensor")] = wait_packet
        setattr(namespace, "wait_tensor", FunctionalOp(wait_packet, self._wrap_wait(wait_packet)))  # noqa: B010
        # a pipeline schedule reduces the gradients (FSDP's post-backward) itself, after its last backward and
        # outside autograd: that is backward traffic (when torch's pipelining is imported before this is called)
        stage = sys.modules.get("torch.distributed.pipelining.stage")
        owner = getattr(stage, "_PipelineStageBase", None)
        method = getattr(owner, "perform_reduce_grad", None)
        if owner is not None and callable(method):
            self._originals[(owner, "perform_reduce_grad")] = method
            setattr(owner, "perform_reduce_grad", self._marked(method, BACKWARD))  # noqa: B010

    def _marked(self, function: Callable[..., Any], phase: str) -> Callable[..., Any]:
        """``function`` with the collectives it issues counted under ``phase``."""

        @functools.wraps(function)
        def marked(*args: Any, **kwargs: Any) -> Any:
            with self._mark(phase):
                return function(*args, **kwargs)

        return marked

    def uninstall(self) -> None:
        for (owner, name), original in self._originals.items():
            setattr(owner, name, original)
        self._originals.clear()

    def _wrap_dist(self, original: Callable[..., Any], op: str, tensor_arg: str, always_async: bool) -> Any:
        get_tensor, get_group, get_async = (
            argument_getter(original, name) for name in (tensor_arg, "group", "async_op")
        )
        peer_args = PEER_ARGUMENTS.get(original.__name__)
        get_peer, get_group_peer = (argument_getter(original, a) for a in peer_args) if peer_args else (None, None)

        @functools.wraps(original)
        def traced(*args: Any, **kwargs: Any) -> Any:
            try:
                if self._inflight:
                    self.poll()
                group = get_group(args, kwargs)
                g = self._group(group)
                phase = self.marked_phase
                if phase is None:
                    in_backward = _graph_task_id() != -1
                    phase = BACKWARD if in_backward else self.default_phase
                    if get_peer and get_group_peer and not in_backward and g.dim == PIPELINE_DIMENSION:
                        peer, group_peer = get_peer(args, kwargs), get_group_peer(args, kwargs)
                        phase = self._p2p_phase(group, op, peer, group_peer) or phase
                key = (g.dim, op, phase)
                nbytes = size_of(get_tensor(args, kwargs))
                is_async = always_async or bool(get_async(args, kwargs))
                if is_async or g.gpu_timed:
                    self._count(key, nbytes, g)
            except Exception as exc:
                self._internal_error(exc)
                return original(*args, **kwargs)
            start = _perf_counter()
            if is_async:
                work = original(*args, **kwargs)
                if work is None:
                    return work
                try:
                    return TimedWork(work, self, key, start, host_timed=not g.gpu_timed)
                except Exception as exc:
                    self._internal_error(exc)
                    return work
            self._blocked = (key, start)
            try:
                work = original(*args, **kwargs)
            finally:
                self._blocked = None
            elapsed = _perf_counter() - start
            if g.gpu_timed:  # counted at issue; its duration comes from the completion hook
                self.add_exposed(elapsed)
            else:
                self._count(key, nbytes, g, elapsed, elapsed)
            return work

        return traced

    def _wrap_batch(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """``batch_isend_irecv``: its sends and receives (traced one by one) are one batch, whose duration comes
        from its one completion on a group timed on the GPU."""

        @functools.wraps(original)
        def traced(p2p_op_list: Any, *args: Any, **kwargs: Any) -> Any:
            batching = False
            try:
                batching = self.begin_batch(p2p_op_list[0].group if p2p_op_list else None)
            except Exception as exc:
                self._internal_error(exc)
            try:
                return original(p2p_op_list, *args, **kwargs)
            finally:
                if batching:
                    try:
                        self.end_batch()
                    except Exception as exc:
                        self._internal_error(exc)

        return traced

    def _wrap_functional(
        self, packet: Any, op: str, tensor_index: int, group_index: int, size_index: int | None
    ) -> Callable[..., Any]:
        def traced(*args: Any, **kwargs: Any) -> Any:
            out = packet(*args, **kwargs)
            try:
                if self._inflight:
                    self.poll()
                g = self._group(args[group_index])
                nbytes = size_of(args[tensor_index]) * (int(args[size_index]) if size_index is not None else 1)
                key = (g.dim, op, self.current_phase())
                self._count(key, nbytes, g)
                pending = self._pending
                pending[buffer_bytes(out)] = (key, _perf_counter(), not g.gpu_timed)
                if len(pending) > _MAX_PENDING:  # outputs whose wait was never seen
                    pending.pop(next(iter(pending)), None)
            except Exception as exc:
                self._internal_error(exc)
            return out

        return traced

    def _wrap_wait(self, packet: Any) -> Callable[..., Any]:
        def traced(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            start = _perf_counter()
            buffer = buffer_bytes(tensor)
            pending = self._pending.pop(buffer, None)
            if pending is None:
                return packet(tensor, *args, **kwargs)
            key, issued, host_timed = pending
            self._blocked = (key, start)
            try:
                out = packet(tensor, *args, **kwargs)
            finally:
                self._blocked = None
            end = _perf_counter()
            try:
                if self._inflight:
                    self.poll()
                if host_timed:
                    self.waited(key, end - start, end - issued)
                else:
                    self.add_exposed(end - start)
            except Exception as exc:
                self._internal_error(exc)
            return out

        return traced
