"""The collective tracer in one process (a real gloo group of one rank), and its NCCL completion-hook path.

NVIDIA GPUs are not available here: ``NcclLikeGroup`` is a faithful fake of the one NCCL-only call the tracer
makes, ``ProcessGroup._register_on_completion_hook``, wrapped around a real gloo group so that the collectives
themselves still run. ``FakeWorkInfo`` has the attributes of ``torch._C._distributed_c10d.WorkInfo``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import OpType  # type: ignore[attr-defined]

from trainer_hooks.collectives import CollectiveTracer
from trainer_hooks.comm_tables import op_label
from trainer_hooks.works import TimedWork, completion_seconds


@dataclass
class FakeWorkInfo:
    op_type: OpType
    active_duration: timedelta
    time_started: datetime
    time_finished: datetime
    seq: int = 0


class NcclLikeGroup:
    """A real gloo group that, like ProcessGroupNCCL, accepts an on-completion hook (the test fires it)."""

    def __init__(self, inner: dist.ProcessGroup) -> None:
        self._inner = inner
        self.hooks: list[Callable[[Any], None]] = []

    def _register_on_completion_hook(self, hook: Callable[[Any], None]) -> None:
        self.hooks.append(hook)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def world() -> dist.ProcessGroup:
    group = dist.group.WORLD
    assert group is not None
    return group


def test_sync_collective_is_counted_with_bytes_and_fully_exposed(tracer: CollectiveTracer) -> None:
    tracer.label(world(), "tp")
    dist.all_reduce(torch.ones(10))  # no group: the default group, here labelled too
    dist.all_reduce(torch.ones(6), group=world())
    dist.all_reduce(torch.ones(2), dist.ReduceOp.SUM, world())  # the group passed by position
    step = tracer.take_step()
    tp = step.ops[("tp", "all_reduce")]
    assert (tp.count, tp.bytes) == (3, 18 * 4)
    assert tp.seconds > 0
    assert step.exposed_s == pytest.approx(step.total_s)
    assert tracer.take_step().ops == {}  # a step's collectives are taken once


def test_a_collective_timed_by_its_caller_is_counted_and_exposed() -> None:
    tracer = CollectiveTracer()  # torchft's process group is out of the tracer's sight: the caller tells it
    tracer.record("dp_replicate", "all_reduce", 4096, 0.25)
    with tracer.phase("optimizer"):
        tracer.record("dp_replicate", "all_reduce", 4, 0.05)
    tracer.record("nonsense", "all_reduce", 8, 0.125)
    step = tracer.take_step()
    backward_or_other = step.phases[("dp_replicate", "all_reduce", tracer.default_phase)]
    assert (backward_or_other.count, backward_or_other.bytes, backward_or_other.seconds) == (1, 4096, 0.25)
    assert step.phases[("dp_replicate", "all_reduce", "optimizer")].bytes == 4
    assert step.ops[("other", "all_reduce")].bytes == 8
    assert step.exposed_s == pytest.approx(0.425)
    tracer.record("dp_replicate", "all_reduce", "many", 0.1)  # type: ignore[arg-type]
    assert tracer.internal_errors == 1


def test_unlabelled_group_is_other(tracer: CollectiveTracer) -> None:
    dist.all_reduce(torch.ones(3))
    assert tracer.take_step().ops[("other", "all_reduce")].bytes == 12


def test_async_work_is_timed_by_its_future_and_wait_is_exposed(tracer: CollectiveTracer) -> None:
    tracer.label(world(), "dp_shard")
    out = torch.empty(8)
    work = dist.all_gather_into_tensor(out, torch.ones(8), group=world(), async_op=True)
    assert isinstance(work, TimedWork)
    assert isinstance(work, dist.Work)
    work.wait()
    step = tracer.take_step()
    stats = step.ops[("dp_shard", "all_gather")]
    assert (stats.count, stats.bytes) == (1, 32)
    assert stats.seconds > 0
    assert 0 <= step.exposed_s <= stats.seconds + 1e-3


def test_functional_collective_timed_at_wait(tracer: CollectiveTracer) -> None:
    tracer.label(world(), "cp")
    out = torch.ops._c10d_functional.all_gather_into_tensor(torch.ones(4), 1, world().group_name)
    torch.ops._c10d_functional.wait_tensor(out)
    stats = tracer.take_step().ops[("cp", "all_gather")]
    assert (stats.count, stats.bytes) == (1, 16)
    assert stats.seconds > 0


def test_p2p_ops_keep_their_identity_for_batch_isend_irecv(tracer: CollectiveTracer) -> None:
    # P2POp checks ``op in (isend, irecv)`` and batch_isend_irecv ``op.op is isend`` against distributed_c10d.
    op = dist.P2POp(dist.isend, torch.ones(2), 0)
    assert op.op is dist.distributed_c10d.isend
    dist.P2POp(dist.irecv, torch.ones(2), 0)


def test_uninstall_restores_torch(tracer: CollectiveTracer) -> None:
    traced = dist.all_reduce
    tracer.uninstall()
    assert dist.all_reduce is not traced
    assert dist.isend is dist.distributed_c10d.isend
    assert not isinstance(torch.ops._c10d_functional.all_reduce, type(traced))
    tracer.install()  # for the fixture's teardown


def test_completion_hook_gives_gpu_durations_and_host_times_are_not_added(tracer: CollectiveTracer) -> None:
    group = NcclLikeGroup(world())
    tracer.label(group, "tp")  # type: ignore[arg-type]
    assert len(group.hooks) == 1
    assert not tracer.host_timed(world())
    dist.all_reduce(torch.ones(5), group=world())  # counted on the host; the duration comes from the hook
    now = datetime.now()
    group.hooks[0](FakeWorkInfo(OpType.ALLREDUCE, timedelta(milliseconds=3), now, now + timedelta(milliseconds=9)))
    stats = tracer.take_step().ops[("tp", "all_reduce")]
    assert (stats.count, stats.bytes) == (1, 20)
    assert stats.seconds == pytest.approx(0.003)
    tracer.label(group, "pp")  # type: ignore[arg-type]
    assert len(group.hooks) == 1  # one hook per group; relabelling changes where its durations go
    group.hooks[0](FakeWorkInfo(OpType.SEND, timedelta(0), now, now + timedelta(milliseconds=2)))
    assert tracer.take_step().ops[("pp", "send")].seconds == pytest.approx(0.002)


class TimingOffGroup(NcclLikeGroup):
    """A real gloo group that refuses the hook as ProcessGroupNCCL does when ``TORCH_NCCL_ENABLE_TIMING`` was not set
    before it was created (torch 2.11 to 2.13: ``TORCH_CHECK_WITH(ValueError, enableTiming_, ...)``)."""

    def _register_on_completion_hook(self, hook: Callable[[Any], None]) -> None:
        raise ValueError(
            "ProcessGroupNCCL OnCompletion hook requires recording start and end events which require setting "
            "TORCH_NCCL_ENABLE_TIMING environment variable. This is only available for NCCL version >= 2.4."
        )


def test_a_refused_completion_hook_falls_back_to_host_timing_and_is_counted(tracer: CollectiveTracer) -> None:
    group = TimingOffGroup(world())
    tracer.label(group, "dp_shard")  # type: ignore[arg-type]  # never raises
    assert tracer.timing_fallbacks == 1
    assert tracer.host_timed(world())
    dist.all_reduce(torch.ones(4), group=world())
    work = dist.all_reduce(torch.ones(4), group=world(), async_op=True)
    assert isinstance(work, TimedWork)
    work.wait()
    stats = tracer.take_step().ops[("dp_shard", "all_reduce")]
    assert (stats.count, stats.bytes) == (2, 32)
    assert stats.seconds > 0  # timed on the host
    tracer.label(group, "tp")  # type: ignore[arg-type]  # relabelled: one group, one fallback
    assert tracer.timing_fallbacks == 1
    tracer.label(dist.new_group([0]), "cp")  # gloo has no hook (RuntimeError): host-timed, not a fallback
    assert tracer.timing_fallbacks == 1


def test_completion_hook_errors_are_counted_not_raised(tracer: CollectiveTracer) -> None:
    group = NcclLikeGroup(world())
    tracer.label(group, "tp")  # type: ignore[arg-type]
    group.hooks[0](object())
    assert tracer.internal_errors == 1


@pytest.mark.parametrize(
    ("op_type", "label"),
    [
        (OpType.ALLREDUCE, "all_reduce"),
        (OpType._ALLGATHER_BASE, "all_gather"),
        (OpType._REDUCE_SCATTER_BASE, "reduce_scatter"),
        (OpType.ALLTOALL_BASE, "all_to_all"),
        (OpType.SEND, "send"),
        (OpType.RECV, "recv"),
        (OpType.BARRIER, "other"),
    ],
)
def test_op_label(op_type: OpType, label: str) -> None:
    assert op_label(op_type) == label


def test_completion_seconds_prefers_gpu_time() -> None:
    t0 = datetime(2026, 1, 1)
    assert completion_seconds(FakeWorkInfo(OpType.SEND, timedelta(microseconds=250), t0, t0 + timedelta(1))) == 250e-6
    assert completion_seconds(FakeWorkInfo(OpType.SEND, timedelta(0), t0, t0 + timedelta(seconds=1.5))) == 1.5


def test_a_completion_never_seen_issued_leaves_the_durations_still_to_come(tracer: CollectiveTracer) -> None:
    """A work the tracer did not see issued (DDP's C++ reducer, an object collective inside c10d) completes on a
    group and op where traced works ran before: its duration counts, and the step still waits for the traced
    all-gather's."""
    group = NcclLikeGroup(world())
    tracer.label(group, "tp")  # type: ignore[arg-type]
    dist.all_reduce(torch.ones(5), group=world())
    dist.all_gather_into_tensor(torch.empty(8), torch.ones(8), group=world())
    now = datetime.now()
    group.hooks[0](FakeWorkInfo(OpType.ALLREDUCE, timedelta(milliseconds=3), now, now + timedelta(milliseconds=9)))
    group.hooks[0](FakeWorkInfo(OpType.ALLREDUCE, timedelta(milliseconds=1), now, now + timedelta(milliseconds=2)))
    step = tracer.take_step()
    assert step.gpu_pending == 1  # the all-gather's duration: still to come
    assert step.ops[("tp", "all_reduce")].seconds == pytest.approx(0.004)


def test_a_batch_of_transfers_completes_once_on_nccl_and_its_transfers_share_its_duration(
    tracer: CollectiveTracer,
) -> None:
    """NCCL launches ``batch_isend_irecv``'s sends and receives as one work, whose completion hook reports the op
    ``COALESCED`` once: the batch's transfers share its duration, which is the stage's wait, and the step waits for
    nothing more. Torch's functions are stood in for (a world of one cannot send): traced as ``install`` traces
    them."""
    group = NcclLikeGroup(world())
    tracer.label(group, "pp")  # type: ignore[arg-type]

    def isend(tensor: Any, dst: Any = None, group: Any = None, tag: int = 0, group_dst: Any = None) -> None:
        return None  # inside NCCL's coalescing an op has no work of its own

    def irecv(tensor: Any, src: Any = None, group: Any = None, tag: int = 0, group_src: Any = None) -> None:
        return None

    def batch_isend_irecv(p2p_op_list: list[Any]) -> list[Any]:
        for p2p in p2p_op_list:
            p2p.op(p2p.tensor, p2p.peer, p2p.group, p2p.tag)
        return []

    send = tracer._wrap_dist(isend, "send", "tensor", True)
    recv = tracer._wrap_dist(irecv, "recv", "tensor", True)
    batch = tracer._wrap_batch(batch_isend_irecv)
    transfers = [
        SimpleNamespace(op=send, tensor=torch.ones(4), peer=0, group=world(), tag=0),
        SimpleNamespace(op=recv, tensor=torch.ones(2), peer=0, group=world(), tag=0),
    ]
    batch(transfers)
    step = tracer.take_step()
    assert step.gpu_pending == 2
    now = datetime.now()
    group.hooks[0](FakeWorkInfo(OpType.COALESCED, timedelta(milliseconds=6), now, now + timedelta(milliseconds=7)))
    assert step.gpu_pending == 0
    assert step.ops[("pp", "send")].seconds == pytest.approx(0.003)
    assert step.ops[("pp", "recv")].seconds == pytest.approx(0.003)
    assert step.pipeline_wait_s == pytest.approx(0.006)  # the bubble, from the GPU's durations
    assert ("pp", "other") not in step.ops
    batch(transfers[:1])  # a batch of one transfer, whose completion names its op
    alone = tracer.take_step()
    group.hooks[0](FakeWorkInfo(OpType.SEND, timedelta(milliseconds=1), now, now + timedelta(milliseconds=2)))
    assert alone.gpu_pending == 0
    assert alone.ops[("pp", "send")].seconds == pytest.approx(0.001)
    assert tracer.internal_errors == 0
