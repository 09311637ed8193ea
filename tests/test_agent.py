"""The agent in one process: ingest, totals, series budget, /metrics and /healthz over real HTTP, bad input."""

from __future__ import annotations

import json
import re
import socket
import stat
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from opsd.policy.xid import WatchWindow
from opsd.protocol.gpu_files import GpuSample
from opsd.protocol.heartbeat import Heartbeat, decode_heartbeat
from opsd.protocol.heartbeat import encode as encode_heartbeat
from opsd.protocol.wire import REASONS, StepReport, decode_report, encode
from opsd.protocol.xid_table import load_xid_table
from opsd_agent.daemon import Agent, AgentConfig
from opsd_agent.gpu import FileGpuSource
from opsd_agent.gpu_access import GpuAccess, GpuAccessCollector
from opsd_agent.health import GpuHealth, GpuHealthCollector
from opsd_agent.metrics import AgentCollector, AgentStats, ReporterCollector
from opsd_agent.rank_gate import DATAGRAM_REFUSALS
from opsd_agent.reporter import Reporter, ReporterConfig
from opsd_agent.state import OVERFLOW, NodeState
from tests.test_wire import FT, report, timeout_report
from tests.waiting import wait_for


def sent(heartbeat: Heartbeat) -> dict[str, Any]:
    """A heartbeat as it goes on the wire (JSON)."""
    body: dict[str, Any] = json.loads(encode_heartbeat(heartbeat))
    return body


def step(**changes: Any) -> StepReport:
    decoded = decode_report(encode(report(**changes)))
    assert isinstance(decoded, StepReport)
    return decoded


def samples_of(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text exposition, by its name and sorted labels."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def samples(agent: Agent) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return samples_of(agent.metrics_text().decode())


def value(agent: Agent, name: str, **labels: str) -> float:
    return samples(agent)[(name, tuple(sorted(labels.items())))]


@pytest.fixture
def agent(tmp_path: Path) -> Agent:
    return Agent(AgentConfig(socket=str(tmp_path / "a.sock"), metrics_port=0, node="n1"))


def test_reports_become_per_rank_metrics(agent: Agent) -> None:
    recently = float(int(time.time())) - 10.0  # ranks quiet for longer leave /metrics (quiet_after_s)
    for step in (1, 2):
        agent.handle(encode(report(step=step, rank=3, step_s=0.25, tokens=512)), now_s=recently + step)
    r = {"run": "r", "rank": "3"}
    assert value(agent, "opsd_step_seconds", **r) == 0.25
    assert value(agent, "opsd_steps_total", **r) == 2
    assert value(agent, "opsd_tokens_total", **r) == 1024
    assert value(agent, "opsd_mfu_ratio", **r) == 0.4
    assert value(agent, "opsd_memory_bytes", kind="rss", **r) == 1 << 30
    assert value(agent, "opsd_rank_last_report_timestamp_seconds", **r) == recently + 2
    comm = {**r, "dimension": "tp", "op": "all_reduce"}
    assert value(agent, "opsd_collectives_total", **comm) == 56  # summed over the two steps
    assert value(agent, "opsd_collective_bytes_total", **comm) == 2 * 917504
    assert value(agent, "opsd_collective_seconds_total", **comm) == pytest.approx(0.02)
    info = {**r, "host": "node-0", "pp": "0", "dp_replicate": "0", "ep": "0", "dp_shard": "1", "cp": "0", "tp": "1"}
    assert value(agent, "opsd_rank_info", **info) == 1
    assert value(agent, "opsd_agent_datagrams_total", node="n1") == 2
    assert value(agent, "opsd_agent_ranks", node="n1") == 1


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"\x00" * 9000, "too_large"),
        (b"{", "not_json"),
        (b"7", "not_object"),
        (json.dumps(report(v=2)).encode(), "version"),
        (json.dumps(report(rank="0")).encode(), "field"),
        (json.dumps(report(kind="x")).encode(), "kind"),
        (json.dumps(report(comms=[["tp", "all_reduce", -1, 0, 0.0]])).encode(), "comms"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_bad_datagrams_are_counted_by_reason_and_dropped(agent: Agent, data: bytes, reason: str) -> None:
    assert agent.handle(data) == reason
    assert value(agent, "opsd_agent_datagrams_rejected_total", node="n1", reason=reason) == 1
    assert value(agent, "opsd_agent_ranks", node="n1") == 0
    assert agent.handle(encode(report())) is None  # and the agent goes on


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=10_000))
def test_no_bytes_crash_the_agent(data: bytes) -> None:
    a = Agent(AgentConfig(socket="/tmp/unused-by-this-test.sock", node="n"))
    reason = a.handle(data)
    assert reason is None or reason in (*REASONS, *DATAGRAM_REFUSALS)  # a signature's too (opsd.protocol.rank_auth)
    assert a.stats.received == 1


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(report())), json_values)
def test_any_field_value_is_ingested_or_counted(field: str, new: Any) -> None:
    a = Agent(AgentConfig(socket="/tmp/unused-by-this-test.sock", node="n"))
    data = json.dumps(report(**{field: new})).encode()
    reason = a.handle(data)
    assert reason is None or reason in REASONS
    a.metrics_text()  # whatever was ingested renders


def test_comm_series_per_rank_are_capped() -> None:
    state = NodeState(max_comm_series=2)
    comms = [["tp", "all_reduce", 1, 8, 0.1], ["pp", "send", 1, 8, 0.1], ["ep", "all_to_all", 1, 8, 0.1]]
    state.ingest(step(comms=comms), now_s=0)
    (rank,) = state.snapshot()
    assert set(rank.comms) == {("tp", "all_reduce"), OVERFLOW}
    assert rank.comms[OVERFLOW].count == 2


def test_stale_ranks_are_forgotten() -> None:
    state = NodeState(stale_after_s=60)
    state.ingest(step(rank=0), now_s=0)
    state.ingest(step(rank=1), now_s=50)
    assert state.expire(now_s=100) == [("r", 0)]
    assert [r.rank for r in state.snapshot()] == [1]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"socket": ""}, "socket must not be empty"),
        ({"socket": "/x" * 60}, "at most 107 bytes"),
        ({"metrics_port": 70000}, "metrics_port must be in 0-65535"),
        ({"node": ""}, "node must not be empty"),
        ({"receive_buffer_bytes": 100}, "receive_buffer_bytes must be >= 8192"),
        ({"stale_after_s": 0}, "stale_after_s must be > 0"),
        ({"max_comm_series": 0}, "max_comm_series must be >= 1"),
    ],
    ids=["empty-socket", "long-socket", "port", "node", "buffer", "stale", "series"],
)
def test_config_validates_itself(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AgentConfig(**{"socket": "/tmp/a.sock", **changes})


@pytest.fixture
def running(agent: Agent) -> Iterator[Agent]:
    agent.start()
    try:
        yield agent
    finally:
        agent.stop()


def get(agent: Agent, path: str) -> tuple[int, str, bytes]:
    url = f"http://127.0.0.1:{agent.metrics_port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


def test_datagrams_over_the_socket_reach_metrics_over_http(running: Agent, tmp_path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as rank:
        rank.sendto(encode(report(rank=5)), running.config.socket)
        rank.sendto(b"garbage", running.config.socket)
    wait_for("two datagrams at the agent", lambda: running.stats.received >= 2, 5, interval_s=0.01)
    status, content_type, body = get(running, "/metrics")
    assert status == 200
    assert content_type.startswith("text/plain")
    assert b'opsd_step_seconds{rank="5",run="r"} 0.2' in body
    assert b'opsd_agent_datagrams_rejected_total{node="n1",reason="not_json"} 1.0' in body
    status, _, body = get(running, "/healthz")
    gpu = {"source": "none", "available": True, "reason": "ok", "detail": "", "gpus": 0}
    assert (status, json.loads(body)) == (200, {"status": "ok", "node": "n1", "ranks": 1, "gpu": gpu})
    assert get(running, "/nope")[0] == 404


def test_a_stale_socket_file_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "a.sock"
    path.write_text("left behind")
    a = Agent(AgentConfig(socket=str(path), metrics_port=0, node="n"))
    a.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as rank:
            rank.sendto(encode(report()), str(path))
        wait_for("datagram at the agent", lambda: a.stats.received >= 1, 5, interval_s=0.01)
        assert a.stats.received == 1
    finally:
        a.stop()
    assert not path.exists()


def documented_metrics() -> dict[str, str]:
    """The metrics documented for the agent (docs/metrics.md up to its "# Controller" part), with their types."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text().split("\n# Controller\n")[0]
    return dict(re.findall(r"^\| `(opsd_\w+)` \| (gauge|counter) \|", text, flags=re.M))


def test_every_exposed_metric_is_documented_with_its_type(agent: Agent, tmp_path: Path) -> None:
    pipeline = {"bubble_s": 0.05, "schedule": "1f1b", "stages": 4, "microbatches": 8}
    checkpoints = [{"step": 1, "blocking_s": 0.1, "total_s": 1.0, "bytes": 10}]
    agent.handle(encode(report(checkpoints=checkpoints, pipeline=pipeline, ft=FT)))
    gpu = GpuHealth(FileGpuSource(tmp_path), load_xid_table(), WatchWindow())
    gpu.samples = [GpuSample(index=0, uuid="GPU-0")]
    gpu.record(0, 79, now_s=0)
    agent.registry.register(GpuHealthCollector(gpu, "n1"))
    reporter = Reporter(ReporterConfig(url="http://127.0.0.1:1/v1/heartbeat"), "n1", agent.state, gpu)
    agent.registry.register(ReporterCollector(reporter, "n1"))
    agent.registry.register(GpuAccessCollector(GpuAccess("none"), "n1"))
    exposed = {}
    for family in text_string_to_metric_families(agent.metrics_text().decode()):
        name = family.name + ("_total" if family.type == "counter" else "")
        exposed[name] = family.type
    assert exposed == documented_metrics()


def test_series_budget_per_rank() -> None:
    pairs = [[f"d{i}", "op", 1, 1, 0.1] for i in range(30)]  # far more pairs than any rank uses
    memory = {"allocated_peak_bytes": 1, "reserved_peak_bytes": 2}
    a = Agent(AgentConfig(socket="/tmp/unused-by-this-test.sock", node="n"))
    checkpoints = [{"step": 1, "blocking_s": 0.1, "total_s": 1.0, "bytes": 10}]
    pipeline = {"bubble_s": 0.05, "schedule": "1f1b", "stages": 4, "microbatches": 8}
    every_part = {"checkpoints": checkpoints, "loss": 2.5, "pipeline": pipeline, "ft": FT}
    a.handle(encode(report(comms=pairs, memory=memory, **every_part)))
    per_rank = [s for family in text_string_to_metric_families(a.metrics_text().decode()) for s in family.samples]
    per_rank = [s for s in per_rank if s.labels.get("rank") == "3"]
    assert len(per_rank) == 24 + 3 * 8  # docs/metrics.md, "Series budget"


def test_a_pipeline_stage_exports_its_bubble_and_tells_the_controller_its_schedule(agent: Agent) -> None:
    pipeline = {"bubble_s": 0.05, "schedule": "gpipe", "stages": 2, "microbatches": 8}
    agent.handle(encode(report(rank=1, step_s=0.2, pipeline=pipeline)))
    agent.handle(encode(report(rank=2, step_s=0.2, pipeline={"bubble_s": 0.5})))  # a wait longer than its step
    agent.handle(encode(report(rank=3)))  # not a pipeline stage: no series
    assert value(agent, "opsd_pipeline_bubble_ratio", run="r", rank="1") == pytest.approx(0.25)
    assert value(agent, "opsd_pipeline_bubble_ratio", run="r", rank="2") == 1.0
    assert ("opsd_pipeline_bubble_ratio", (("rank", "3"), ("run", "r"))) not in samples(agent)
    reporter = Reporter(ReporterConfig(url="http://127.0.0.1:9/v1/heartbeat"), "n1", agent.state, None)
    ranks = {r["rank"]: r.get("pipeline") for r in sent(reporter.heartbeat(1.0))["ranks"]}
    assert ranks[1] == {"bubble_ratio": pytest.approx(0.25), "schedule": "gpipe", "stages": 2, "microbatches": 8}
    assert ranks[2] == {"bubble_ratio": 1.0, "schedule": "", "stages": 0, "microbatches": 0}
    assert ranks[3] is None


def test_the_heartbeat_tells_the_controller_each_ranks_world_size(agent: Agent) -> None:
    """The controller plans how often to ask for the ranks from the job's size (``opsd.policy.telemetry``)."""
    agent.handle(encode(report(rank=1, world_size=98_304)))
    agent.handle(encode(report(rank=2)))
    reporter = Reporter(ReporterConfig(url="http://127.0.0.1:9/v1/heartbeat"), "n1", agent.state, None)
    ranks = decode_heartbeat(encode_heartbeat(reporter.heartbeat(1.0))).ranks
    assert {r.rank: r.world_size for r in ranks} == {1: 98_304, 2: 4}


def test_a_replica_group_rank_exports_its_quorum_and_tells_the_controller_its_sums(agent: Agent) -> None:
    healed = {**FT, "quorum_replicas": 2, "participants": 1, "healing_s": 0.25, "quorum_wait_s": 1.0}
    agent.handle(encode(report(rank=5, step=40, ft=healed)))
    agent.handle(encode(report(rank=5, step=40, ft={**FT, "committed": False, "quorum_wait_s": 0.5})))
    agent.handle(encode(report(rank=5, step=41, ft={**FT, "quorum_id": 5, "quorum_replicas": 1, "healing_s": 0.0})))
    agent.handle(encode(report(rank=6)))  # not in a replica group: no series
    r = {"run": "r", "rank": "5"}
    assert value(agent, "opsd_ft_quorum_replica_groups", **r) == 1  # the last step's quorum
    assert value(agent, "opsd_ft_healing_seconds_total", **r) == pytest.approx(0.28)  # 0.25 + 0.03 + 0
    assert ("opsd_ft_quorum_replica_groups", (("rank", "6"), ("run", "r"))) not in samples(agent)
    reporter = Reporter(ReporterConfig(url="http://127.0.0.1:9/v1/heartbeat"), "n1", agent.state, None)
    ranks = {r["rank"]: r.get("ft") for r in sent(reporter.heartbeat(1.0))["ranks"]}
    assert ranks[5] == {
        "replica_group": 1,
        "replica_groups": 2,
        "quorum_id": 5,
        "quorum_replicas": 1,
        "participants": 1,
        "committed": True,
        "heals": 2,
        "healing_total_s": pytest.approx(0.28),
        "quorum_wait_total_s": pytest.approx(2.0),
        "discarded_steps": 1,
    }
    assert ranks[6] is None
    assert decode_heartbeat(encode_heartbeat(reporter.heartbeat(1.0))).ranks[0].ft is not None  # the controller's


def test_checkpoints_become_counters_and_last_values(agent: Agent) -> None:
    first = {"step": 100, "blocking_s": 0.5, "total_s": 4.0, "bytes": 1000, "staging_s": 0.125}
    second = {"step": 200, "blocking_s": 0.25, "total_s": 3.0, "bytes": 1000}
    agent.handle(encode(report(checkpoints=[first])))
    agent.handle(encode(report()))
    agent.handle(encode(report(checkpoints=[second])))
    r = {"run": "r", "rank": "3"}
    assert value(agent, "opsd_checkpoints_total", **r) == 2
    assert value(agent, "opsd_checkpoint_bytes_total", **r) == 2000
    assert value(agent, "opsd_checkpoint_seconds_total", phase="blocking", **r) == 0.75
    assert value(agent, "opsd_checkpoint_seconds_total", phase="total", **r) == 7.0
    assert value(agent, "opsd_checkpoint_seconds_total", phase="staging", **r) == 0.125  # absent in the second: 0
    too_many = report(checkpoints=[first] * 5)
    assert agent.handle(encode(too_many)) == "field"


def test_skipped_checkpoints_and_timing_fallbacks_are_exported_once_there_are_some(agent: Agent) -> None:
    agent.handle(encode(report(rank=3)))
    names = {name for name, _ in samples(agent)}
    assert not names & {"opsd_checkpoints_skipped_total", "opsd_rank_comm_timing_fallbacks_total"}
    agent.handle(encode(report(rank=3, checkpoints_skipped_total=2, comm_timing_fallbacks_total=1)))
    assert value(agent, "opsd_checkpoints_skipped_total", run="r", rank="3") == 2
    assert value(agent, "opsd_rank_comm_timing_fallbacks_total", run="r", rank="3") == 1


def test_a_collective_timeout_goes_to_the_controller_until_the_rank_steps_on(agent: Agent) -> None:
    agent.handle(encode(report(step=7, rank=1)), now_s=100.0)
    assert agent.handle(encode(timeout_report(step=7, rank=1)), now_s=101.0) is None
    reporter = Reporter(ReporterConfig(url="http://127.0.0.1:9/v1/heartbeat"), "n1", agent.state, None)
    assert sent(reporter.heartbeat(102.0))["timeouts"] == [
        {"run": "r", "rank": 1, "step": 7, "time_unix_s": 1.5e9, "dim": "tp", "op": "all_reduce", "waited_s": 301.5}
    ]
    agent.handle(encode(report(step=8, rank=1)), now_s=103.0)  # it stepped on: the wait is over
    assert sent(reporter.heartbeat(104.0))["timeouts"] == []


def test_the_socket_and_the_dump_directory_are_open_to_ranks_of_any_user(tmp_path: Path) -> None:
    """On Kubernetes the agent runs as root and the training pods as their own users, on one host directory."""
    path, flight = tmp_path / "a.sock", tmp_path / "run" / "flight"
    config = AgentConfig(
        socket=str(path),
        metrics_port=0,
        node="n",
        controller_url="http://127.0.0.1:9/v1/heartbeat",
        flight_dir=str(flight),
    )
    a = Agent(config)
    a.start()
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o666
        assert stat.S_IMODE(flight.stat().st_mode) == 0o1777  # as /tmp: anyone writes, only owners remove
    finally:
        a.stop()


def test_a_rank_quiet_for_long_leaves_metrics_and_comes_back_with_its_totals() -> None:
    """After a swap the ranks of the node that left stop reporting: within ``quiet_after_s`` (and 10 of their steps)
    they leave /metrics, so the dashboards do not draw them as flat lines beside their replacements; a rank that
    reports again is back with its totals (forgotten only after ``stale_after_s``)."""
    clock = [1000.0]
    state = NodeState()
    collector = AgentCollector(state, AgentStats(), "n", quiet_after_s=30.0, clock=lambda: clock[0])
    registry = CollectorRegistry()
    registry.register(collector)

    def steps_of() -> dict[str, float]:
        text = generate_latest(registry).decode()
        found = re.findall(r'^opsd_steps_total\{rank="(\d+)",run="job"\} (\S+)$', text, flags=re.M)
        assert re.search(rf'^opsd_agent_ranks\{{node="n"\}} {float(len(found))}$', text, flags=re.M)
        return {rank: float(n) for rank, n in found}

    for rank, step_s in ((0, 0.2), (1, 10.0)):
        decoded = decode_report(encode(report(run="job", rank=rank, step=1, step_s=step_s)))
        assert isinstance(decoded, StepReport)
        state.ingest(decoded, now_s=1000.0)
    assert steps_of() == {"0": 1.0, "1": 1.0}
    clock[0] = 1031.0  # rank 0 (0.2 s steps) quiet for 31 s: gone; rank 1 (10 s steps) has 100 s
    assert steps_of() == {"1": 1.0}
    clock[0] = 1101.0
    assert steps_of() == {}
    again = decode_report(encode(report(run="job", rank=0, step=2, step_s=0.2)))
    assert isinstance(again, StepReport)
    state.ingest(again, now_s=1101.0)
    assert steps_of() == {"0": 2.0}  # its totals kept
