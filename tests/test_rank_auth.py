"""The run's key: a pod elsewhere that reaches an agent's network endpoints cannot feed it reports, read its policy
or send it dumps (``opsd.protocol.rank_auth``, ``opsd_agent.rank_gate``). Real sockets on loopback, the rank's side as
the hooks run it, with ``$OPSD_RANK_KEY`` and ``$OPSD_RUN`` as a training pod's template gives them."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from opsd.cli import settings
from opsd.errors import ConfigError
from opsd.protocol.env import AGENT_SOCKET_ENV, RANK_KEY_ENV, RUN_ENV
from opsd.protocol.node_agent import FLIGHT_PATH, POLICY_PATH
from opsd.protocol.rank_auth import RankAuth, headers, run_key, sign, split_signed, verify
from opsd.protocol.wire import WireError, encode
from opsd_agent.daemon import Agent, AgentConfig
from tests.test_agent_over_the_network import env_of, network_agent
from tests.test_wire import report
from tests.waiting import wait_for
from trainer_hooks.policy_reader import PolicyReader, policy_source
from trainer_hooks.sinks import DatagramSink, UdpSink, agent_sink

SECRET = "the-ranks-secret"
KEY = run_key(SECRET, "llm")


def test_each_run_has_its_own_key_and_a_tag_covers_every_byte() -> None:
    assert run_key(SECRET, "llm") == KEY
    assert len(KEY) == 64
    assert run_key(SECRET, "llm2") != KEY
    assert run_key("another-secret", "llm") != KEY
    with pytest.raises(ValueError, match="secret must not be empty"):
        run_key("", "llm")
    body = encode(report(run="llm"))
    tag, taken = split_signed(sign(body, KEY))
    assert taken == body
    assert tag is not None
    assert verify(tag, body, KEY)
    assert not verify(tag, body.replace(b'"step":', b'"step" :'), KEY)
    assert not verify(tag, body, run_key(SECRET, "llm2"))
    assert split_signed(body) == (None, body)  # unsigned: as it came
    with pytest.raises(WireError, match="32 hex digits"):
        split_signed(b"opsd-sig1:abc\n" + body)


def gated(tmp_path: Path, mode: RankAuth) -> Agent:
    return network_agent(tmp_path, rank_secret=SECRET, rank_auth=mode)


@pytest.fixture
def required(tmp_path: Path) -> Iterator[Agent]:
    agent = gated(tmp_path, RankAuth.REQUIRED)
    agent.start()
    try:
        yield agent
    finally:
        agent.stop()


def send_udp(agent: Agent, data: bytes) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(data, ("127.0.0.1", agent.datagram_port))


def test_where_the_key_is_required_only_the_runs_own_signed_reports_are_taken(required: Agent) -> None:
    body = encode(report(run="llm", rank=3, step=7))
    sent = {
        "signed with the run's key": sign(body, KEY),
        "unsigned": body,
        "signed with another run's key": sign(body, run_key(SECRET, "other")),
        "signed, then changed": sign(body, KEY).replace(b'"rank":3', b'"rank":4'),
        "a signature that is not one": b"opsd-sig1:xyz\n" + body,
        "another run's report with that run's key": sign(encode(report(run="other", step=99)), KEY),
    }
    for data in sent.values():
        send_udp(required, data)
    wait_for("every datagram", lambda: required.stats.received == len(sent), 10, interval_s=0.01)
    assert [(r.run, r.rank, r.last.step) for r in required.state.snapshot()] == [("llm", 3, 7)]
    rejected = {k: v for k, v in required.stats.rejected.items() if v}
    assert rejected == {"unsigned": 1, "bad_signature": 3, "signature": 1}
    metrics = required.metrics_text().decode()
    assert 'opsd_agent_datagrams_rejected_total{node="n1",reason="bad_signature"} 3.0' in metrics
    # the Unix socket in the host directory asks for no key: who writes there is the host's permissions
    sink = DatagramSink(required.config.socket)
    sink.send(encode(report(run="local", rank=0, step=1)))
    sink.close()
    wait_for("the socket's report", lambda: len(required.state.snapshot()) == 2, 10, interval_s=0.01)


def test_where_it_is_optional_unsigned_reports_are_taken_and_counted_and_a_wrong_key_is_not(tmp_path: Path) -> None:
    agent = gated(tmp_path, RankAuth.OPTIONAL)
    agent.start()
    try:
        body = encode(report(run="llm", rank=0, step=5))
        send_udp(agent, body)
        send_udp(agent, sign(body, run_key(SECRET, "other")))
        wait_for("both datagrams", lambda: agent.stats.received == 2, 10, interval_s=0.01)
        assert [r.last.step for r in agent.state.snapshot()] == [5]
        assert agent.stats.rejected["bad_signature"] == 1
        metrics = agent.metrics_text().decode()
        assert 'opsd_agent_unsigned_total{endpoint="datagram",node="n1"} 1.0' in metrics
    finally:
        agent.stop()


def call(agent: Agent, path: str, header: dict[str, str], body: bytes | None = None) -> tuple[int, Any]:
    url = f"http://127.0.0.1:{agent.metrics_port}{path}"
    request = urllib.request.Request(url, data=body, headers=header, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


def dump(run: str) -> bytes:
    return json.dumps({"run": run, "trigger": "incident-1", "rank": 0, "pg_status": {}}).encode()


def test_the_policy_and_the_dumps_ask_for_the_runs_key(required: Agent) -> None:
    assert call(required, POLICY_PATH, {})[0] == 401
    assert call(required, POLICY_PATH, headers("llm", run_key(SECRET, "other")))[1]["refused"] == "bad_key"
    assert call(required, POLICY_PATH, headers("llm", KEY)) == (200, {"v": 1})
    assert call(required, FLIGHT_PATH, {}, dump("llm"))[0] == 401
    status, answer = call(required, FLIGHT_PATH, headers("llm", KEY), dump("other"))  # the key of llm, a dump of other
    assert (status, answer["refused"]) == (403, "other_run")
    stored = call(required, FLIGHT_PATH, headers("llm", KEY), dump("llm"))
    assert stored == (201, {"stored": "llm/incident-1/rank-0.json"})
    spool = Path(str(required.config.flight_dir))
    assert sorted(p.relative_to(spool).as_posix() for p in spool.rglob("*.json")) == ["llm/incident-1/rank-0.json"]
    assert required.ranks.refused == {"unsigned": 2, "bad_key": 1, "other_run": 1}
    assert 'opsd_agent_requests_refused_total{node="n1",reason="other_run"} 1.0' in required.metrics_text().decode()


def test_the_hooks_sign_with_the_key_their_pod_was_given(required: Agent, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank of a pod without the host directory, as the hooks run it: its step reports and its policy reads are
    taken by an agent that requires the key; the same rank without it is refused."""
    from trainer_hooks.monitor import Monitor, MonitorConfig

    for name, value in {**env_of(required), RANK_KEY_ENV: KEY, RUN_ENV: "llm"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(AGENT_SOCKET_ENV, raising=False)
    monitor = Monitor(None, MonitorConfig(trace_collectives=False))
    try:
        assert [type(s).__name__ for s in monitor.sinks] == ["UdpSink"]
        for _ in range(3):
            with monitor.step(tokens=8):
                pass
        wait_for("three steps", lambda: required.stats.received == 3, 10, interval_s=0.01)
    finally:
        monitor.close()  # it says the rank ends: one datagram more
    wait_for("the steps and the rank's end", lambda: required.stats.received == 4, 10, interval_s=0.01)
    assert [(r.run, r.steps_total) for r in required.state.snapshot()] == [("llm", 3)]
    reader = PolicyReader(policy_source(), check_every_s=3600)
    reader.fetch_once()
    reader.close()
    assert reader.errors == 0

    monkeypatch.delenv(RANK_KEY_ENV)
    unsigned = agent_sink()
    assert isinstance(unsigned, UdpSink)
    unsigned.send(encode(report(run="llm", step=4)))
    wait_for("the unsigned report", lambda: required.stats.received == 5, 10, interval_s=0.01)
    unsigned.close()
    assert required.stats.rejected["unsigned"] == 1
    without = PolicyReader(policy_source(), check_every_s=3600)  # its thread reads once at start too
    without.fetch_once()
    without.close()
    assert without.errors >= 1
    assert required.ranks.refused["unsigned"] >= 1  # refused for want of the key


def test_a_mode_that_asks_for_a_key_needs_the_secret() -> None:
    with pytest.raises(ValueError, match=r"rank_auth required needs agent\.rank_secret"):
        AgentConfig(rank_auth=RankAuth.REQUIRED)
    # optional without a secret (an existing Secret without the key): nothing to check against, nothing asked
    assert Agent(AgentConfig(rank_auth=RankAuth.OPTIONAL)).ranks.mode is RankAuth.OFF
    agent = settings.load("agent", env={"OPSD_AGENT_RANK_AUTH": "optional", "OPSD_AGENT_RANK_SECRET": SECRET})
    assert (agent.rank_auth, agent.rank_secret) == (RankAuth.OPTIONAL, SECRET)
    with pytest.raises(ConfigError, match="rank_auth"):
        settings.load("agent", env={"OPSD_AGENT_RANK_AUTH": "sometimes", "OPSD_AGENT_RANK_SECRET": SECRET})
