"""Liveness datagrams end to end: the real API on uvicorn takes them in its liveness worker, acknowledges the good ones
and counts what it refuses; the real agent reporter says it is alive by datagram between its heartbeats, falls back to
heartbeats over HTTP while its datagrams go unacknowledged, and comes back to them."""

from __future__ import annotations

import http.client
import json
import math
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from opsd.api.auth import Credentials
from opsd.backends.local.processes import free_port
from opsd.controller.config import ControllerConfig
from opsd.controller.controller import Controller
from opsd.controller.state import StateStore
from opsd.policy.telemetry import TelemetryConfig
from opsd.protocol.heartbeat import VERSION, Heartbeat, encode
from opsd.protocol.liveness import Signer, decode_ack, decode_alive, encode_ack, encode_alive, liveness_key
from opsd_agent.reporter import Reporter, ReporterConfig
from opsd_agent.state import NodeState
from tests.serving import start_api
from tests.test_agent import step
from tests.test_reporter import Controller as StandIn
from tests.waiting import wait_for

CREDENTIALS = Credentials(
    operator="op-token", reader="reader-token", agent="agent-token", agent_previous="agent-token-before-rotation"
)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Controller, int]]:
    """The controller's API on uvicorn, liveness datagrams on a free UDP port; agents asked for their ranks every
    3 s (the shortest interval it asks for)."""
    store = StateStore.open(f"sqlite:///{tmp_path_factory.mktemp('liveness') / 'opsd.db'}")
    controller = Controller(store, ControllerConfig(telemetry=TelemetryConfig(min_interval_s=3.0)))
    port = free_port()
    server = start_api(controller, CREDENTIALS, "127.0.0.1", port)
    try:
        yield controller, port
    finally:
        server.should_exit = True


def request(port: int, method: str, path: str, token: str, body: bytes | None = None) -> Any:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body, headers={"Authorization": f"Bearer {token}"})
        response = conn.getresponse()
        assert response.status == 200, response.read()
        data = response.read()
        return json.loads(data) if path != "/metrics" else data.decode()
    finally:
        conn.close()


def refused(port: int) -> dict[str, float]:
    text = request(port, "GET", "/metrics", "op-token")
    return {
        s.labels["reason"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "opsd_controller_liveness_refused_total"
    }


def answer(sock: socket.socket, timeout_s: float = 10.0) -> bytes:
    ready, _, _ = select.select([sock], [], [], timeout_s)
    assert ready, "no acknowledgement"
    return sock.recv(64)


def test_the_api_acknowledges_good_datagrams_and_counts_what_it_refuses(api: tuple[Controller, int]) -> None:
    controller, port = api
    beat = encode(Heartbeat(v=VERSION, node="n-api", time_unix_s=time.time()))
    reply = request(port, "POST", "/v1/heartbeat", "agent-token", beat)
    assert reply["liveness_port"] == controller.liveness_port
    assert reply["telemetry_interval_s"] == 3.0
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.connect(("127.0.0.1", reply["liveness_port"]))
    agent, operator, reader = (Signer(liveness_key(t)) for t in ("agent-token", "op-token", "reader-token"))
    seq = int(controller.clock() * 1000)
    bad = [
        b"garbage",  # malformed
        encode_alive("n-api", seq, reader),  # a reader's token may not send heartbeats: mac
        encode_alive("n-api", seq - 3_600_000, agent),  # an hour old: skew
        encode_alive("n-api", seq, agent)[:4] + b"\x07" + encode_alive("n-api", seq, agent)[5:],  # version
    ]
    good = encode_alive("n-api", seq, agent)
    try:
        for data in bad:
            sock.send(data)
        sock.send(good)
        assert decode_ack(answer(sock)) == (seq, good[-16:])  # the first answer is the good one's
        sock.send(good)  # a replay
        by_operator = encode_alive("n-api", seq + 1, operator)  # an operator's token does what an agent's may
        sock.send(by_operator)
        assert decode_ack(answer(sock)) == (seq + 1, by_operator[-16:])
        # an agent not yet rolled onto rotated tokens signs with its previous one: taken too
        by_previous = encode_alive("n-api", seq + 2, Signer(liveness_key("agent-token-before-rotation")))
        sock.send(by_previous)
        assert decode_ack(answer(sock)) == (seq + 2, by_previous[-16:])
    finally:
        sock.close()
    expected = {"malformed": 1, "version": 1, "mac": 1, "replay": 1, "skew": 1}
    wait_for("the refusals counted (batches come from the liveness worker)", lambda: refused(port) == expected, 10)
    assert refused(port) == expected
    assert controller.nodes["n-api"].liveness_seq == seq + 2


def test_the_agent_says_it_is_alive_by_datagram_between_its_heartbeats(
    api: tuple[Controller, int], tmp_path: Path
) -> None:
    """Against the real API, asked for its ranks every 3 s: heartbeats at the first beat and every third one, a
    datagram every beat from the first reply on, each acknowledged; nothing over HTTP in between."""
    controller, port = api
    now = time.time()
    state = NodeState()
    state.ingest(step(rank=0, step=1), now_s=now)
    config = ReporterConfig(url=f"http://127.0.0.1:{port}/v1/heartbeat", token="agent-token")
    reporter = Reporter(config, "n-agent", state, None)
    before = controller.heartbeats_total
    try:
        reporter.beat(now, mono_s=0.0)  # a heartbeat, whose reply names the port
        assert reporter.liveness is not None
        assert reporter.telemetry_interval_s == 3.0
        for i in range(1, 7):
            reporter.beat(now + i, mono_s=float(i))
            ready, _, _ = select.select([reporter.liveness.sock], [], [], 10.0)
            assert ready, "no acknowledgement"  # back before the next beat
        assert controller.heartbeats_total - before == 3  # at 0, 3 and 6 s
        reporter.beat(now + 7, mono_s=7.0)
        assert (reporter.liveness.sent, reporter.liveness.acknowledged, reporter.liveness.errors) == (7, 6, 0)
        assert not reporter.over_http
        sent = reporter.liveness.seq
        wait_for("the last datagram taken", lambda: controller.nodes["n-agent"].liveness_seq == sent, 10)
    finally:
        reporter.stop()


@pytest.fixture
def stand_in() -> Iterator[tuple[StandIn, socket.socket]]:
    """A stand-in controller whose replies name a UDP port where the test decides what is acknowledged."""
    controller = StandIn(token="agent-token")
    controller.start()
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    controller.reply = {"ack_events_up_to": 0, "telemetry_interval_s": 10.0, "liveness_port": udp.getsockname()[1]}
    try:
        yield controller, udp
    finally:
        controller.stop()
        udp.close()


def acknowledge(udp: socket.socket) -> None:
    data, address = udp.recvfrom(512)
    _, seq, tag = decode_alive(data, [Signer(liveness_key("agent-token"))])
    udp.sendto(encode_ack(seq, tag), address)


def test_the_agent_falls_back_to_http_while_its_datagrams_go_unacknowledged(
    stand_in: tuple[StandIn, socket.socket],
) -> None:
    controller, udp = stand_in
    reporter = Reporter(ReporterConfig(url=controller.url, token="agent-token"), "n7", NodeState(), None)
    kinds: list[str] = []
    # the node's slot of the 10 s interval began half a second before its first beat: its next one at the tenth beat
    now = math.floor(time.time() / 10.0) * 10.0 + reporter.phase_ratio * 10.0 + 0.5

    def beat(at_s: float) -> None:
        count = len(controller.requests)
        reporter.beat(now + at_s, mono_s=at_s)
        new = [body for _, body in controller.requests[count:]]
        kinds.append(("ranks" if new[0]["summaries"] else "liveness") if new else "-")

    try:
        beat(0)  # a heartbeat, whose reply names the port
        for at_s in range(1, 4):  # acknowledged: datagrams only
            beat(at_s)
            acknowledge(udp)
        assert kinds == ["ranks", "-", "-", "-"]
        for at_s in range(4, 8):  # a firewall now drops them: two beats later, liveness over HTTP
            beat(at_s)
            udp.recvfrom(512)
        assert kinds[4:] == ["-", "-", "liveness", "liveness"]
        assert reporter.over_http
        beat(8)
        acknowledge(udp)  # through again
        beat(9)
        assert kinds[8:] == ["liveness", "-"]
        assert not reporter.over_http
        beat(10)  # the ranks' interval is up
        assert kinds[10] == "ranks"
    finally:
        reporter.stop()


def test_against_an_older_controller_the_agent_sends_everything_every_beat(
    stand_in: tuple[StandIn, socket.socket],
) -> None:
    controller, _ = stand_in
    controller.reply = {"ack_events_up_to": 0}  # neither an interval nor a port
    reporter = Reporter(ReporterConfig(url=controller.url, token="agent-token"), "n7", NodeState(), None)
    try:
        now = time.time()
        for at_s in range(3):
            reporter.beat(now + at_s, mono_s=float(at_s))
        assert [len(body["summaries"]) for _, body in controller.requests] == [1, 1, 1]  # each with the ranks
        assert reporter.liveness is None
        assert reporter.over_http
        assert reporter.telemetry_interval_s is None
    finally:
        reporter.stop()
