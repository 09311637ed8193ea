"""The monitor's GPU paths, driven on CPU: step reports that wait for the device without waiting on it, collective
durations that arrive after their step, and a completion hook refused at start-up.

No GPU here: ``FakeDevice`` plays the one thing the monitor asks of CUDA events (``record`` on the stream,
``query`` without blocking, ``elapsed_time`` once both are done, ``synchronize``): its events complete when the
test runs the device past them. The completion hooks are fired by the test, as NCCL's watchdog thread would, late.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import OpType  # type: ignore[attr-defined]
from torch.distributed.device_mesh import init_device_mesh

from opsd.protocol.wire import StepReport, decode, decode_report
from opsd_agent.daemon import Agent, AgentConfig
from tests.test_collectives import FakeWorkInfo, NcclLikeGroup
from trainer_hooks.collectives import CollectiveTracer
from trainer_hooks.comm_tables import StepComms
from trainer_hooks.deferred import PendingStep, PendingSteps
from trainer_hooks.monitor import Monitor, MonitorConfig


class FakeDevice:
    """A device that runs its queue only when told: ``queue(ms)`` is work the host launched, ``run_to(ms)`` the
    device getting that far. An event completes once the device ran past the point where it was recorded."""

    def __init__(self) -> None:
        self.queued_ms = 0.0
        self.done_ms = 0.0
        self.syncs = 0

    def queue(self, ms: float) -> None:
        self.queued_ms += ms

    def run_to(self, ms: float) -> None:
        self.done_ms = ms

    def event(self) -> FakeEvent:
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.at_ms: float | None = None

    def record(self) -> None:
        self.at_ms = self.device.queued_ms

    def query(self) -> bool:
        return self.at_ms is not None and self.device.done_ms >= self.at_ms

    def elapsed_time(self, end: FakeEvent) -> float:
        if not (self.query() and end.query()):  # as torch.cuda.Event: both must have completed
            raise RuntimeError("elapsed_time: event not completed")
        assert self.at_ms is not None
        assert end.at_ms is not None
        return end.at_ms - self.at_ms

    def synchronize(self) -> None:
        self.device.syncs += 1
        assert self.at_ms is not None
        self.device.done_ms = max(self.device.done_ms, self.at_ms)


def lines(path: Path) -> list[dict[str, Any]]:
    return [decode(line) for line in path.read_bytes().splitlines()] if path.exists() else []


def config(tmp_path: Path, **changes: Any) -> MonitorConfig:
    return MonitorConfig(
        run_id="gpu", jsonl_path=str(tmp_path / "steps.jsonl"), trace_collectives=False, close_wait_s=0, **changes
    )


def test_step_time_and_loss_come_from_the_device_once_done_never_by_waiting(tmp_path: Path) -> None:
    device = FakeDevice()
    m = Monitor(None, config(tmp_path), tracer=CollectiveTracer(), events=device.event)
    out = tmp_path / "steps.jsonl"
    for ms, loss in ((40.0, 2.5), (30.0, 2.25)):
        with m.step(tokens=100):
            device.queue(ms)  # the step's kernels, launched: the host is done long before the device
            m.record_loss(torch.tensor(loss))
    assert lines(out) == []  # nothing done on the device yet: nothing reported, nothing waited for
    device.run_to(40.0)  # the first step's work is done
    with m.step(tokens=100):
        device.queue(35.0)
    (first,) = lines(out)  # reported during the third step's end, labelled with its own step
    assert (first["step"], first["step_s"], first["loss"]) == (1, pytest.approx(0.040), 2.5)
    assert first["tokens_per_s"] == pytest.approx(100 / 0.040)
    assert device.syncs == 0  # the steps never waited for the device
    m.close()  # the end of training may wait: the last steps go out
    assert [(r["step"], r["step_s"], r.get("loss")) for r in lines(out)] == [
        (1, pytest.approx(0.040), 2.5),
        (2, pytest.approx(0.030), 2.25),
        (3, pytest.approx(0.035), None),
    ]
    assert lines(out)[-1]["internal_errors_total"] == 0


def test_a_step_the_device_never_finishes_goes_out_after_the_pending_bound(tmp_path: Path) -> None:
    device = FakeDevice()
    m = Monitor(None, config(tmp_path, max_pending_steps=2), tracer=CollectiveTracer(), events=device.event)
    for _ in range(4):
        with m.step(tokens=1):
            device.queue(10.0)
    reports = lines(tmp_path / "steps.jsonl")
    assert [r["step"] for r in reports] == [1, 2]  # two newer steps wait behind each: it went out incomplete
    assert 0 < reports[0]["step_s"] < 0.01  # its time on the host, the only one there is
    assert [r["internal_errors_total"] for r in reports] == [1, 2]  # counted
    assert device.syncs == 0


def waiting(host_s: float, ended_s: float, *, durations_to_come: int = 1) -> PendingStep:
    """A step of ``host_s`` on the host that ended at ``ended_s``, whose collectives' durations are still to come."""
    return PendingStep(1, 1, host_s, 0.0, StepComms(gpu_pending=durations_to_come), {}, ended_s=ended_s)


#: name: (steps as (host_s, ended_s, durations still to come), now_s, how many of the oldest are handed out)
BOUNDS = {
    # steps of 5 ms whose durations the watchdog reports ~100 ms late: 20 of them wait (16 forced one out before)
    "short steps, a late watchdog: all wait": ([(0.005, 0.005 * i, 1) for i in range(20)], 0.1, 0),
    "the oldest is complete: it goes, and the next waits": ([(0.005, 0.0, 0), (0.005, 0.005, 1)], 0.01, 1),
    "incomplete for longer than max_wait_s: out as it is": ([(0.005, 0.0, 1), (0.005, 0.005, 1)], 5.001, 1),
    "both overdue: both out, in order": ([(0.005, 0.0, 1), (0.005, 0.005, 1)], 5.006, 2),
    "a 10 s step waits 4 x its time, not 5 s": ([(10.0, 0.0, 1)], 39.0, 0),
    "... and goes after them": ([(10.0, 0.0, 1)], 40.001, 1),
    "past the count bound: the oldest goes, however young": ([(0.001, 0.001 * i, 1) for i in range(1025)], 1.1, 1),
}


@pytest.mark.parametrize(("steps", "now_s", "out"), BOUNDS.values(), ids=BOUNDS.keys())
def test_an_incomplete_step_is_held_by_time_first_then_by_count(
    steps: list[tuple[float, float, int]], now_s: float, out: int
) -> None:
    defaults = MonitorConfig()  # the monitor's bounds: 5 s (and 4 x the step), 1024 steps
    pending = PendingSteps(defaults.max_pending_steps, defaults.max_pending_s)
    for host_s, ended_s, to_come in steps:
        pending.add(waiting(host_s, ended_s, durations_to_come=to_come))
    handed = pending.ready(now_s)
    assert len(handed) == out
    assert [s.ended_s for s in handed] == [ended for _, ended, _ in steps[:out]]  # the oldest, in order
    assert pending.incomplete == sum(1 for s in handed if s.comms.gpu_pending)


def test_collective_durations_that_arrive_after_their_step_are_reported_with_it(
    tracer: CollectiveTracer, tmp_path: Path
) -> None:
    group = NcclLikeGroup(dist.group.WORLD)  # type: ignore[arg-type]
    tracer.label(group, "dp_shard")  # type: ignore[arg-type]
    m = Monitor(None, config(tmp_path), tracer=tracer)  # on CPU: host step times; the durations come from hooks
    out = tmp_path / "steps.jsonl"

    def hook_fires(ms: float) -> None:  # NCCL's watchdog thread, once the work is done on the GPU
        now = datetime.now()
        group.hooks[0](FakeWorkInfo(OpType.ALLREDUCE, timedelta(milliseconds=ms), now, now))

    with m.step(tokens=1):
        dist.all_reduce(torch.ones(4))
    with m.step(tokens=1):
        dist.all_reduce(torch.ones(8))
        with m.phase("optimizer"):
            dist.all_reduce(torch.ones(2))
    assert lines(out) == []  # both steps wait for their durations
    hook_fires(3.0)  # the first step's all-reduce, done after that step ended
    with m.step(tokens=1):
        pass
    assert [r["step"] for r in lines(out)] == [1]
    hook_fires(5.0)
    hook_fires(7.0)
    m.close()
    reports = lines(out)
    assert [r["step"] for r in reports] == [1, 2, 3]
    assert reports[0]["comms"] == [["dp_shard", "all_reduce", 1, 16, pytest.approx(0.003), "forward"]]
    assert reports[1]["comms"] == [
        ["dp_shard", "all_reduce", 1, 32, pytest.approx(0.005), "forward"],
        ["dp_shard", "all_reduce", 1, 8, pytest.approx(0.007), "optimizer"],
    ]
    assert reports[2]["comms"] == []  # no duration lands in a later step
    assert all(r["internal_errors_total"] == 0 for r in reports)


def test_a_refused_completion_hook_never_stops_training_and_is_reported(
    tracer: CollectiveTracer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(self: dist.ProcessGroup, hook: Any) -> None:  # ProcessGroupNCCL without TORCH_NCCL_ENABLE_TIMING
        raise ValueError("ProcessGroupNCCL OnCompletion hook requires ... TORCH_NCCL_ENABLE_TIMING")

    monkeypatch.setattr(dist.ProcessGroup, "_register_on_completion_hook", refuse)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    m = Monitor.from_mesh(mesh, None, config(tmp_path), tracer=tracer)
    with m.step(tokens=1):
        dist.all_reduce(torch.ones(4), group=mesh.get_group("dp_shard"))
    m.close()
    (report,) = lines(tmp_path / "steps.jsonl")
    assert report["comm_timing_fallbacks_total"] == 1
    ((dim, op, count, _, seconds, _),) = report["comms"]
    assert (dim, op, count) == ("dp_shard", "all_reduce", 1)
    assert seconds > 0  # timed on the host, and the report says so
    assert report["comm_host_timed_s"] == seconds
    agent = Agent(AgentConfig(socket=str(tmp_path / "a.sock"), metrics_port=0, node="n1"))
    agent.handle((tmp_path / "steps.jsonl").read_bytes().strip())
    metrics = agent.metrics_text().decode()
    assert 'opsd_rank_comm_timing_fallbacks_total{rank="0",run="gpu"} 1.0' in metrics
    assert f'opsd_rank_comm_host_timed_seconds_total{{rank="0",run="gpu"}} {seconds!r}' in metrics
    decoded = decode_report((tmp_path / "steps.jsonl").read_bytes().strip())
    assert isinstance(decoded, StepReport)
    assert decoded.comm_timing_fallbacks_total == 1
