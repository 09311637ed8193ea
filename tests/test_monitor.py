"""The monitor in one process: its report, its sinks, and that it never raises into or blocks training."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from opsd.protocol.wire import decode, decode_report
from tests.waiting import wait_for
from trainer_hooks.collectives import CollectiveTracer
from trainer_hooks.comm_tables import Blocked
from trainer_hooks.flops import ModelShape, flops_per_token
from trainer_hooks.monitor import Monitor, MonitorConfig

SHAPE = ModelShape(n_layers=2, n_heads=4, head_dim=16, seq_len=128, dense_matmul_params=100_000)


def monitor(tmp_path: Path, **config: Any) -> Monitor:
    # A tracer of its own, not installed: these tests issue no collectives.
    defaults: dict[str, Any] = {
        "jsonl_path": str(tmp_path / "steps.jsonl"),
        "cpu_peak_flops_per_s": 1e9,
        "trace_collectives": False,
    }
    return Monitor(SHAPE, MonitorConfig(**{**defaults, **config}), tracer=CollectiveTracer())


def lines(tmp_path: Path) -> list[dict[str, Any]]:
    return [decode(line) for line in (tmp_path / "steps.jsonl").read_bytes().splitlines()]


def test_step_report_figures(tmp_path: Path) -> None:
    m = monitor(tmp_path)
    with m.step(tokens=1000):
        time.sleep(0.02)  # the step's work: what it measures
    m.close()
    (r,) = lines(tmp_path)
    assert r["step"] == 1
    assert r["step_s"] >= 0.02
    assert r["tokens_per_s"] == pytest.approx(1000 / r["step_s"])
    assert r["job_tokens_per_s"] == r["tokens_per_s"]  # one data-parallel shard
    assert r["mfu_ratio"] == pytest.approx(r["tokens_per_s"] * flops_per_token(SHAPE) / 1e9)
    assert r["compute_s"] == r["step_s"]  # no collectives
    assert r["memory"]["rss_bytes"] > 0
    assert r["comms"] == []


def test_a_monitor_takes_out_the_tracer_it_put_in(tmp_path: Path) -> None:
    """Closed, a monitor leaves ``torch.distributed`` as it found it: its tracer out, one installed before left in."""
    original = dist.all_reduce
    m = Monitor(SHAPE, MonitorConfig(jsonl_path=str(tmp_path / "a.jsonl")), tracer=CollectiveTracer())
    assert dist.all_reduce is not original
    m.close()
    assert dist.all_reduce is original
    ours = CollectiveTracer()
    ours.install()
    try:
        Monitor(SHAPE, MonitorConfig(jsonl_path=str(tmp_path / "b.jsonl")), tracer=ours).close()
        assert ours.installed
    finally:
        ours.uninstall()
    assert dist.all_reduce is original


def test_begin_end_calls_and_batch_shards(tmp_path: Path) -> None:
    m = Monitor(
        SHAPE, MonitorConfig(jsonl_path=str(tmp_path / "steps.jsonl")), batch_shards=8, tracer=CollectiveTracer()
    )
    for _ in range(3):
        m.begin_step()
        m.end_step(tokens=10)
    m.end_step(tokens=10)  # an end without a begin is ignored
    m.close()
    reports = lines(tmp_path)
    assert [r["step"] for r in reports] == [1, 2, 3]
    assert reports[0]["job_tokens_per_s"] == pytest.approx(8 * reports[0]["tokens_per_s"])


def test_measured_flops_override_the_formula(tmp_path: Path) -> None:
    m = Monitor(SHAPE, MonitorConfig(trace_collectives=False), flops_per_token=123.0, tracer=CollectiveTracer())
    assert m.flops_per_token == 123.0
    with pytest.raises(ValueError, match="flops_per_token must be > 0"):
        Monitor(SHAPE, MonitorConfig(), flops_per_token=0.0, tracer=CollectiveTracer())


def test_missing_agent_socket_only_counts_drops(tmp_path: Path) -> None:
    m = monitor(tmp_path, socket_path=str(tmp_path / "absent.sock"))
    for _ in range(3):
        with m.step(tokens=1):
            pass
    assert m.dropped_reports == 3
    assert [r["dropped_reports_total"] for r in lines(tmp_path)] == [0, 1, 2]


def test_reports_reach_a_listening_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(tmp_path / "agent.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as agent:
        agent.bind(path)
        monkeypatch.setenv("OPSD_AGENT_SOCKET", path)
        m = Monitor(SHAPE, MonitorConfig(run_id="job-1"), tracer=CollectiveTracer())
        with m.step(tokens=5):
            pass
        agent.settimeout(5)
        received = decode(agent.recv(65536))
        m.close()
    assert received["run"] == "job-1"
    assert received["tokens"] == 5
    assert m.dropped_reports == 0


def test_full_agent_buffer_never_blocks(tmp_path: Path) -> None:
    path = str(tmp_path / "agent.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as agent:
        agent.bind(path)  # bound, never read: the buffer fills
        m = Monitor(SHAPE, MonitorConfig(socket_path=path, trace_collectives=False), tracer=CollectiveTracer())
        start = time.perf_counter()
        for _ in range(2000):
            m.begin_step()
            m.end_step(tokens=1)
        assert time.perf_counter() - start < 10
        m.close()
    assert m.dropped_reports > 0


def test_training_errors_propagate_and_a_step_that_raised_is_no_step(tmp_path: Path) -> None:
    """A step whose block raised (a peer died in its all-reduce, a NaN check) did not happen: it is neither reported
    nor counted, so the controller never takes a step the rank did not finish for progress (a killed peer's survivor
    once reported the step it died in, and a relaunch's lost steps were counted one too many)."""
    m = monitor(tmp_path)

    def dies_in_its_all_reduce() -> None:
        with m.step(tokens=1):
            torch.ones(2).sum()
            raise RuntimeError("peer closed")

    with pytest.raises(RuntimeError, match="peer closed"):
        dies_in_its_all_reduce()
    assert (m.steps, m.internal_errors) == (0, 0)
    with m.step(tokens=4):
        pass
    m.close()
    assert [(line["step"], line["tokens"]) for line in lines(tmp_path) if line["kind"] == "step"] == [(1, 4)]


def test_internal_failures_are_counted_not_raised(tmp_path: Path) -> None:
    m = monitor(tmp_path)

    def broken() -> None:
        raise OSError("tracer broke")

    m.tracer.take_step = broken  # type: ignore[method-assign,assignment]
    with m.step(tokens=1):
        pass
    with m.step(tokens=1):
        pass
    assert m.internal_errors == 4  # begin and end of each step
    assert [r["comms"] for r in lines(tmp_path)] == [[], []]  # the steps are still reported
    assert lines(tmp_path)[-1]["internal_errors_total"] == 4  # its own step's included


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"run_id": ""}, "run_id must not be empty"),
        ({"peak_flops_per_s": 0}, "peak_flops_per_s must be > 0"),
        ({"cpu_peak_flops_per_s": -1.0}, "cpu_peak_flops_per_s must be > 0"),
    ],
    ids=["empty-run", "zero-peak", "negative-cpu-peak"],
)
def test_config_validates_itself(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MonitorConfig(**config)


def test_checkpoints_ride_on_the_next_report(tmp_path: Path) -> None:
    m = monitor(tmp_path)
    m.record_checkpoint(step=10, blocking_s=0.2, total_s=2.5, nbytes=4096, staging_s=0.125)
    with m.step(tokens=1):
        pass
    with m.step(tokens=1):
        pass
    for i in range(6):
        m.record_checkpoint(step=i, blocking_s=0.1, total_s=1.0, nbytes=1)
    with m.step(tokens=1):
        pass
    reports = lines(tmp_path)
    assert reports[0]["checkpoints"] == [
        {"step": 10, "blocking_s": 0.2, "total_s": 2.5, "staging_s": 0.125, "bytes": 4096}
    ]
    assert "checkpoints" not in reports[1]
    assert [c["step"] for c in reports[2]["checkpoints"]] == [2, 3, 4, 5]  # the bound: oldest dropped, counted
    assert reports[2]["internal_errors_total"] == 2


def test_skipped_checkpoints_are_counted_in_every_later_report(tmp_path: Path) -> None:
    m = monitor(tmp_path)
    with m.step(tokens=1):
        pass
    m.record_checkpoint_skipped(20)
    for _ in range(2):
        with m.step(tokens=1):
            pass
    reports = lines(tmp_path)
    assert [r.get("checkpoints_skipped_total") for r in reports] == [None, 1, 1]


def test_steps_are_numbered_from_the_step_resumed_from(tmp_path: Path) -> None:
    m = monitor(tmp_path)
    with m.step(tokens=1):
        pass
    m.resume_at(20)
    with m.step(tokens=1):
        pass
    with m.step(tokens=1):
        pass
    reports = lines(tmp_path)
    assert [r["step"] for r in reports] == [1, 21, 22]
    assert "resumed_from_step" not in reports[0]
    assert [r["resumed_from_step"] for r in reports[1:]] == [20, 20]  # every report of the launch says it
    raw = (tmp_path / "steps.jsonl").read_bytes().splitlines()
    assert [getattr(decode_report(line), "resumed_from_step", None) for line in raw] == [None, 20, 20]  # typed
    with pytest.raises(ValueError, match="step must be >= 0"):
        m.resume_at(-1)


def test_a_replica_group_rank_reports_as_the_job_and_each_step_with_its_quorum(tmp_path: Path) -> None:
    m = Monitor(
        SHAPE,
        MonitorConfig(jsonl_path=str(tmp_path / "steps.jsonl"), cpu_peak_flops_per_s=1e9, trace_collectives=False),
        coords={"dp_shard": 1},
        batch_shards=2,
        tracer=CollectiveTracer(),
    )
    m.world_size, m.rank, m.flight.rank = 2, 1, 1  # rank 1 of a group of 2
    m.watch_replica_group(2, 3)
    with m.step(tokens=10):  # healed: the job's step, from its peers
        m.record_quorum(
            step=41, quorum_id=7, quorum_replicas=3, participants=2, committed=True, healing_s=0.2, quorum_wait_s=1.5
        )
    with m.step(tokens=10):  # discarded: the same step again
        m.record_quorum(step=41, quorum_id=8, quorum_replicas=2, participants=2, committed=False)
    with m.step(tokens=10):  # no quorum told: no ft part
        pass
    m.close()
    first, second, third = lines(tmp_path)
    assert (first["rank"], first["world_size"], first["coords"]) == (5, 6, {"dp_shard": 1, "dp_replicate": 2})
    assert first["job_tokens_per_s"] == pytest.approx(4 * first["tokens_per_s"])  # 2 shards x 2 groups that trained
    assert third["job_tokens_per_s"] == pytest.approx(6 * third["tokens_per_s"])  # no quorum told: all 3 groups
    assert m.flight.rank == 5
    assert [r["step"] for r in (first, second, third)] == [41, 41, 42]
    assert first["ft"] == {
        "replica_group": 2,
        "replica_groups": 3,
        "quorum_id": 7,
        "quorum_replicas": 3,
        "participants": 2,
        "committed": True,
        "healing_s": 0.2,
        "quorum_wait_s": 1.5,
    }
    assert (second["ft"]["committed"], second["ft"]["healing_s"], second["ft"]["quorum_id"]) == (False, 0.0, 8)
    assert "ft" not in third
    with pytest.raises(ValueError, match="already told"):
        m.watch_replica_group(0, 3)
    with pytest.raises(ValueError, match=r"group 3 must be in \[0, 3\)"):
        Monitor(SHAPE, MonitorConfig(trace_collectives=False), tracer=CollectiveTracer()).watch_replica_group(3, 3)


class Waiting(CollectiveTracer):
    """A tracer whose training thread waits on a tp all-reduce (``since`` names the wait)."""

    def __init__(self) -> None:
        super().__init__()
        self.since: float | None = 1.0
        self.asked = 0  # the watchdog asks once a round: its rounds so far

    def blocked(self) -> Blocked | None:
        self.asked += 1
        return None if self.since is None else Blocked("tp", "all_reduce", self.since, 5.0)


def test_a_long_wait_on_a_collective_is_reported_once_per_wait(tmp_path: Path) -> None:
    tracer = Waiting()
    config = MonitorConfig(jsonl_path=str(tmp_path / "steps.jsonl"), collective_timeout_s=0.2)
    m = Monitor(SHAPE, config, tracer=tracer)
    try:

        def reported(n: int) -> list[dict[str, Any]]:
            """The reports once there are ``n`` and the watchdog has gone 3 more rounds (still ``n``: once a wait)."""
            path = tmp_path / "steps.jsonl"
            wait_for(f"report {n}", lambda: path.exists() and len(lines(tmp_path)) >= n, 10)
            rounds = tracer.asked
            wait_for("3 more rounds of the watchdog", lambda: tracer.asked > rounds + 3, 10)
            return lines(tmp_path)

        (first,) = reported(1)
        assert (first["kind"], first["dim"], first["op"], first["waited_s"]) == (
            "collective_timeout",
            "tp",
            "all_reduce",
            5.0,
        )
        tracer.since = 2.0  # the next wait
        assert [x["kind"] for x in reported(2)] == ["collective_timeout"] * 2
        assert m.timeouts_reported == 2
    finally:
        m.close()
        tracer.uninstall()
