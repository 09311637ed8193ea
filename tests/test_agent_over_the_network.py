"""A rank reaches its node's agent with no host directory (a training pod without hostPath): step reports as UDP
datagrams to the agent's port at $OPSD_AGENT_HOST, the policy and the Flight Recorder dumps over the agent's HTTP.
Real sockets on loopback; the rank's side never blocks nor raises, and counts what it could not deliver."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from opsd.protocol.env import AGENT_DATAGRAM_PORT_ENV, AGENT_HOST_ENV, AGENT_HTTP_PORT_ENV, AGENT_SOCKET_ENV
from opsd.protocol.heartbeat import HeartbeatReply
from opsd.protocol.node_agent import FLIGHT_PATH, MAX_DUMP_BYTES, POLICY_PATH, AgentAddress, agent_address
from opsd.protocol.policy_file import EMPTY, CheckpointCadence, Policy
from opsd.protocol.wire import encode
from opsd_agent.daemon import Agent, AgentConfig
from opsd_agent.reporter import Reporter, ReporterConfig
from tests.test_wire import report
from tests.waiting import wait_for
from trainer_hooks.policy_reader import PolicyReader, policy_source
from trainer_hooks.sinks import DatagramSink, UdpSink, agent_sink


def network_agent(tmp_path: Path, **changes: Any) -> Agent:
    """An agent of node n1 with a UDP port and a dump directory, on any free ports; ``changes`` to its config."""
    base = {"socket": str(tmp_path / "a.sock"), "metrics_port": 0, "node": "n1", "datagram_port": 0}
    return Agent(AgentConfig(**{**base, "flight_dir": str(tmp_path / "spool"), **changes}))


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    a = network_agent(tmp_path)
    a.start()
    try:
        yield a
    finally:
        a.stop()


def env_of(agent: Agent) -> dict[str, str]:
    """What a training pod's template gives its ranks: the node's address and the agent's host ports."""
    return {
        AGENT_HOST_ENV: "127.0.0.1",
        AGENT_DATAGRAM_PORT_ENV: str(agent.datagram_port),
        AGENT_HTTP_PORT_ENV: str(agent.metrics_port),
    }


def test_the_agents_address_from_the_environment() -> None:
    assert agent_address({}) is None
    assert agent_address({AGENT_HOST_ENV: "10.0.3.7"}) == AgentAddress("10.0.3.7", 9465, 9464)
    address = agent_address({AGENT_HOST_ENV: "fd00::7", AGENT_DATAGRAM_PORT_ENV: "19465", AGENT_HTTP_PORT_ENV: "1"})
    assert address is not None
    assert address.datagrams == ("fd00::7", 19465)
    assert address.policy_url == "http://[fd00::7]:1/v1/policy"
    with pytest.raises(ValueError, match="OPSD_AGENT_DATAGRAM_PORT must be a port number"):
        agent_address({AGENT_HOST_ENV: "h", AGENT_DATAGRAM_PORT_ENV: "udp"})
    with pytest.raises(ValueError, match="datagram port must be in 1-65535"):
        agent_address({AGENT_HOST_ENV: "h", AGENT_DATAGRAM_PORT_ENV: "70000"})
    # the rank's side turns a bad address into none (logged), never an exception
    assert agent_sink(environ={AGENT_HOST_ENV: "h", AGENT_DATAGRAM_PORT_ENV: "udp"}) is None
    assert policy_source(environ={AGENT_HOST_ENV: "h", AGENT_HTTP_PORT_ENV: "x"}) is None


def test_a_socket_wins_over_the_network() -> None:
    both = {AGENT_SOCKET_ENV: "/run/opsd/agent.sock", AGENT_HOST_ENV: "10.0.0.1"}
    assert isinstance(agent_sink(environ=both), DatagramSink)
    assert policy_source(environ={"OPSD_POLICY_FILE": "/run/opsd/policy.json", AGENT_HOST_ENV: "10.0.0.1"}) == (
        "/run/opsd/policy.json"
    )
    assert policy_source(environ={AGENT_HOST_ENV: "10.0.0.1"}) == "http://10.0.0.1:9464/v1/policy"
    assert agent_sink(environ={}) is None


def test_reports_reach_the_agent_as_udp_datagrams(agent: Agent) -> None:
    sink = agent_sink(environ=env_of(agent))
    assert isinstance(sink, UdpSink)
    sink.send(encode(report(rank=4, step=17)))
    sink.send(b"not json")  # a bad datagram: counted by the agent, as on the socket
    wait_for("second datagram", lambda: agent.stats.received == 2, 10, interval_s=0.01)
    sink.close()
    (rank,) = agent.state.snapshot()
    assert (rank.rank, rank.last.step) == (4, 17)
    assert agent.stats.rejected["not_json"] == 1
    assert sink.dropped == 0


def test_the_monitor_sends_to_the_agent_at_its_host(agent: Agent, monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer hooks as a pod without the host directory runs them: only $OPSD_AGENT_HOST and the ports."""
    from trainer_hooks.monitor import Monitor, MonitorConfig

    for key, value in env_of(agent).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv(AGENT_SOCKET_ENV, raising=False)
    monitor = Monitor(None, MonitorConfig(run_id="net", trace_collectives=False))
    try:
        assert [type(s).__name__ for s in monitor.sinks] == ["UdpSink"]
        for _ in range(3):
            with monitor.step(tokens=8):
                pass
        wait_for(
            "third step",
            lambda: agent.state.snapshot() and agent.state.snapshot()[0].steps_total == 3,
            10,
            interval_s=0.01,
        )
    finally:
        monitor.close()
    assert agent.state.snapshot()[0].run == "net"


def test_sending_never_blocks_and_what_cannot_be_delivered_is_counted() -> None:
    # nobody listens on the port: the kernel's "port unreachable" fails a later send, which is counted
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as held:
        held.bind(("127.0.0.1", 0))
        closed_port = held.getsockname()[1]
    nobody = UdpSink("127.0.0.1", closed_port)
    for _ in range(20):
        nobody.send(encode(report()))
    assert nobody.dropped >= 1
    # an agent that never reads: its buffer fills, the sender neither blocks nor raises (the kernel drops)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as deaf:
        deaf.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        deaf.bind(("127.0.0.1", 0))
        sink = UdpSink("127.0.0.1", deaf.getsockname()[1])
        assert sink._sock is not None
        assert sink._sock.getblocking() is False
        big = b"x" * 8192
        for _ in range(5000):
            sink.send(big)
        sink.close()
    # a name that does not resolve, an address with no route: every report dropped, counted
    nowhere = UdpSink("opsd-agent.invalid", 9465)
    for _ in range(3):
        nowhere.send(b"{}")
    assert nowhere.dropped == 3
    unroutable = UdpSink("192.0.2.1", 9465)  # TEST-NET-1: no agent there, whether or not a route leads out
    for _ in range(100):
        unroutable.send(b"{}")
    unroutable.close()


def test_the_policy_comes_from_the_agents_http_and_never_holds_up_the_caller(agent: Agent) -> None:
    url = f"http://127.0.0.1:{agent.metrics_port}{POLICY_PATH}"
    with urllib.request.urlopen(url, timeout=5) as r:
        assert json.load(r) == {"v": 1}  # nothing from a controller yet
    reader = PolicyReader(url, check_every_s=0.02)
    try:
        assert reader.remote
        agent.reporter = Reporter(ReporterConfig(url="http://127.0.0.1:1/v1/heartbeat"), "n1", agent.state, None)
        policy = Policy(checkpoint=CheckpointCadence(every_steps=50, from_step=100))
        agent.reporter._apply(HeartbeatReply(ack_events_up_to=0, policy=policy))
        wait_for("new cadence", lambda: reader.current() == policy, 10, interval_s=0.01)
        assert reader.current().checkpoint_due(150)
    finally:
        reader.close()


def test_a_policy_url_that_hangs_costs_the_training_thread_nothing() -> None:
    """An agent that accepts the connection and never answers: the reader's thread waits on it, the caller does not
    (each of its calls returns the policy it has)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # connections complete in the backlog; nothing is ever read or answered
        reader = PolicyReader(f"http://127.0.0.1:{silent.getsockname()[1]}/v1/policy", timeout_s=30.0)
        try:
            for _ in range(10_000):
                assert reader.current() == EMPTY
            assert reader.errors == 0  # its thread still waits on the first answer
        finally:
            reader.close()


def post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, data=body, method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def test_a_dump_sent_to_the_agent_lands_where_a_rank_with_the_directory_writes_it(agent: Agent, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{agent.metrics_port}{FLIGHT_PATH}"
    dump = {"v": 1, "run": "llm/70b", "trigger": "cmd-3", "rank": 5, "trace": {"entries": []}}
    status, answer = post(url, json.dumps(dump).encode())
    assert (status, answer) == (201, {"stored": "llm_70b/cmd-3/rank-5.json"})
    assert json.loads((tmp_path / "spool" / "llm_70b" / "cmd-3" / "rank-5.json").read_text()) == dump
    assert post(url, b"[1, 2]")[0] == 400
    assert post(url, json.dumps({**dump, "rank": -1}).encode())[0] == 400
    status, answer = post(url, b"{}", {"Content-Length": str(MAX_DUMP_BYTES + 1)})
    assert status == 413
    assert agent.intake.counts == {"ok": 1, "rejected": 2, "too_large": 1, "busy": 0}
    assert not list((tmp_path / "spool").rglob("*.tmp"))


def test_the_flight_recorder_of_a_rank_without_the_directory_sends_its_dump(
    agent: Agent, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainer_hooks.flight import FlightRecorder

    for key, value in env_of(agent).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("OPSD_FLIGHT_DIR", raising=False)
    monkeypatch.delenv("OPSD_POLICY_FILE", raising=False)
    recorder = FlightRecorder("net", 2, 4)
    assert recorder.policy is not None
    assert recorder.policy.remote
    recorder.policy.close()
    assert recorder.dump("timeout-2-9") == f"http://127.0.0.1:{agent.metrics_port}{FLIGHT_PATH}"
    kept = json.loads((tmp_path / "spool" / "net" / "timeout-2-9" / "rank-2.json").read_text())
    assert (kept["run"], kept["rank"], kept["world_size"], kept["trigger"]) == ("net", 2, 4, "timeout-2-9")
    assert "test_the_flight_recorder_of_a_rank" in kept["stack"]
    agent.stop()  # the agent gone: the dump fails, counted, not raised
    assert recorder.dump("later") is None
    assert recorder.errors == 1


@pytest.mark.parametrize(
    ("token", "status"),
    [
        pytest.param(None, 401, id="no token"),
        pytest.param("scrape-new", 200, id="the current token"),
        pytest.param("scrape-old", 200, id="the previous token, during a rotation"),
        pytest.param("scrape-unknown", 401, id="a token it does not know"),
    ],
)
def test_metrics_want_the_current_or_the_previous_token(tmp_path: Path, token: str | None, status: int) -> None:
    config = AgentConfig(
        socket=str(tmp_path / "a.sock"),
        metrics_port=0,
        node="n1",
        metrics_token="scrape-new",
        previous_metrics_token="scrape-old",
    )
    agent = Agent(config)
    agent.start()
    try:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        request = urllib.request.Request(f"http://127.0.0.1:{agent.metrics_port}/metrics", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                got = r.status
        except urllib.error.HTTPError as exc:
            got = exc.code
        assert got == status
        with urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/healthz", timeout=10) as r:
            assert r.status == 200  # open: the kubelet's probe holds no token
    finally:
        agent.stop()
