"""The heartbeat process (``opsd.api.heartbeat_worker``): what it answers itself and what it sends to the API, as a
table; the real process beside the real API with the real agent (heartbeats moved to it by a reply, taken by the
controller, the policy mirrored, bad requests refused and counted, the API going on without it when it dies); and
the agent's way to it and back (421, a port that does not answer)."""

from __future__ import annotations

import http.client
import logging
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from opsd.api.heartbeat_ingest import Told
from opsd.api.heartbeat_worker import MAX_BODY_BYTES, Mirror, View, WorkerConfig
from opsd.backends.local.processes import free_port
from opsd.controller.config import ControllerConfig
from opsd.controller.controller import Controller
from opsd.controller.state import StateStore
from opsd.policy.telemetry import TelemetryConfig
from opsd.protocol.heartbeat import (
    SEND_TO_API,
    VERSION,
    Heartbeat,
    HeartbeatEvent,
    HeartbeatRank,
    HeartbeatReply,
    encode,
)
from opsd.protocol.policy_file import EMPTY, Policy
from opsd_agent import reporter as reporter_module
from opsd_agent.reporter import Reporter, ReporterConfig, with_port
from opsd_agent.state import NodeState
from tests.serving import start_api
from tests.test_agent import step
from tests.test_liveness import CREDENTIALS, request
from tests.test_reporter import Controller as StandIn
from tests.waiting import wait_for

NOW_S = 1_800_000_000.0


def beat(node: str, runs: tuple[str, ...] = ("r1",), events: int = 0) -> Heartbeat:
    ranks = [
        HeartbeatRank(run=run, rank=i, host=node, step=5, step_s=1.0, last_report_unix_s=NOW_S)
        for i, run in enumerate(runs)
    ]
    gpu_events = [
        HeartbeatEvent(seq=s, gpu=0, xid=79, action="cordon_and_swap", reason="fell off the bus", time_s=NOW_S)
        for s in range(1, events + 1)
    ]
    return Heartbeat(v=VERSION, node=node, time_unix_s=NOW_S, ranks=ranks, events=gpu_events)


TOLD = View(
    interval_s=3.0,
    liveness_port=8470,
    heartbeat_port=8471,
    policies={"r1": Policy(checkpoint_at_step=9), "r0": EMPTY},
    runs_gone=[],
    nodes={"n1": ("r1", 4), "n0": ("r0", 0), "n3": ("r3", 0)},
    nodes_gone=[],
)


def reply(ack: int, policy: Policy | None) -> HeartbeatReply:
    return HeartbeatReply(
        ack_events_up_to=ack, policy=policy, telemetry_interval_s=3.0, liveness_port=8470, heartbeat_port=8471
    )


#: a heartbeat -> the process's reply (None: 421, to the API)
CASES: dict[str, tuple[Heartbeat, HeartbeatReply | None]] = {
    "a known node of its run": (beat("n1"), reply(4, Policy(checkpoint_at_step=9))),
    "a known node without ranks": (beat("n1", runs=()), reply(4, Policy(checkpoint_at_step=9))),
    "a run whose policy is empty": (beat("n0", runs=("r0",)), reply(0, None)),
    "a node it was not told of": (beat("n9"), None),
    "GPU events": (beat("n1", events=2), None),
    "a rank of another run (new, or the node moved)": (beat("n1", runs=("r1", "r2")), None),
    "a run not told a policy yet": (beat("n3", runs=("r3",)), None),
}


@pytest.mark.parametrize(("body", "expected"), list(CASES.values()), ids=list(CASES))
def test_what_the_process_answers_itself(body: Heartbeat, expected: HeartbeatReply | None) -> None:
    mirror = Mirror()
    mirror.apply(TOLD)
    assert mirror.answer(body) == expected


def test_views_apply_in_order() -> None:
    mirror = Mirror()
    assert mirror.answer(beat("n1")) is None  # told nothing yet
    mirror.apply(TOLD)
    mirror.apply(View(5.0, None, 8471, {"r1": EMPTY}, ["r0"], {"n2": ("r1", 0)}, ["n1"]))
    assert mirror.answer(beat("n1")) is None  # gone: the API's from now on
    assert mirror.answer(beat("n0", runs=("r0",))) is None  # its run told no policy any more
    assert mirror.answer(beat("n2")) == HeartbeatReply(
        ack_events_up_to=0, policy=None, telemetry_interval_s=5.0, heartbeat_port=8471
    )
    mirror.apply(View(5.0, None, None, {}, [], {}, []))
    assert mirror.answer(beat("n2")) is None  # no port: the process is closing


def test_with_port() -> None:
    assert with_port("https://opsd:8470/v1/heartbeat", 8471) == "https://opsd:8471/v1/heartbeat"
    assert with_port("http://[::1]:80/v1/heartbeat", 9000) == "http://[::1]:9000/v1/heartbeat"
    assert with_port("http://opsd/v1/heartbeat", 9000) == "http://opsd:9000/v1/heartbeat"


def counters(port: int) -> dict[str, float]:
    text = request(port, "GET", "/metrics", "op-token")
    return {
        s.name + "".join(f"{{{v}}}" for v in s.labels.values()): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith(("opsd_controller_heartbeats", "opsd_controller_rejected"))
    }


def post(port: int, body: bytes, token: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", "/v1/heartbeat", body=body, headers={"Authorization": f"Bearer {token}"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def raw(port: int, data: bytes) -> bytes:
    """What the server answers ``data`` with, up to its closing the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(data)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
        return answer


@pytest.fixture
def served(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> Iterator[tuple[Controller, int, int]]:
    """The real API with its heartbeat process on a free port: (controller, the API's port, the process's pid)."""
    controller = Controller(
        StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"),
        ControllerConfig(telemetry=TelemetryConfig(min_interval_s=3.0)),
    )
    port = free_port()
    with caplog.at_level(logging.INFO, logger="opsd.api.heartbeat_ingest"):
        server = start_api(controller, CREDENTIALS, "127.0.0.1", port, heartbeat_port=0)
    found = re.search(
        rf"heartbeats answered on tcp 127.0.0.1:{controller.heartbeat_port} \(process (\d+)\)", caplog.text
    )
    assert found is not None, caplog.text
    try:
        yield controller, port, int(found.group(1))
    finally:
        server.should_exit = True


def test_the_agent_moves_to_the_process_and_the_controller_takes_what_it_answered(
    served: tuple[Controller, int, int], caplog: pytest.LogCaptureFixture
) -> None:
    controller, port, pid = served
    state = NodeState()
    state.ingest(step(rank=0, step=1), now_s=time.time())
    run = state.snapshot()[0].run
    reporter = Reporter(
        ReporterConfig(url=f"http://127.0.0.1:{port}/v1/heartbeat", token="agent-token"), "n-a", state, None
    )
    try:
        assert reporter.send_once(time.time())  # to the API: a new node of a new run
        assert reporter.apart is not None
        assert reporter.apart.port == controller.heartbeat_port
        assert counters(port)["opsd_controller_heartbeats_apart_total"] == 0

        def answered_apart() -> bool:  # the process is told of the node within 50 ms: until then, 421 and the API
            assert reporter.send_once(time.time())
            return counters(port)["opsd_controller_heartbeats_apart_total"] >= 1

        wait_for("a heartbeat answered by the heartbeat process", answered_apart, 10)

        def taken() -> dict[str, float] | None:  # every heartbeat delivered taken (the process's within 50 ms)
            now = counters(port)
            return now if now["opsd_controller_heartbeats_total"] == reporter.sent_ok else None

        before = wait_for("every heartbeat taken", taken, 10)
        state.ingest(step(rank=0, step=2), now_s=time.time())
        controller.ask_checkpoint(run, 50)
        for _ in range(3):
            assert reporter.send_once(time.time())
        wait_for("the three taken", taken, 10, context=lambda: f"{before} -> {counters(port)}")
        after = counters(port)
        assert after["opsd_controller_heartbeats_apart_total"] == before["opsd_controller_heartbeats_apart_total"] + 3
        assert (
            after["opsd_controller_heartbeats_sent_to_api_total"]
            == before["opsd_controller_heartbeats_sent_to_api_total"]
        )
        live = controller.live_of(run)
        assert live is not None
        assert live.ranks[0].step == 2  # what the process answered, taken
        wait_for(
            "the one-off checkpoint in the policy the process answers",
            lambda: reporter.send_once(time.time()) and reporter.last_policy == Policy(checkpoint_at_step=50),
            10,
        )

        # bad requests to the process: refused and counted with the API's
        heartbeat_port = controller.heartbeat_port
        assert heartbeat_port is not None
        assert post(heartbeat_port, encode(beat("n-a", runs=(run,))), "nobody")[0] == 401
        assert post(heartbeat_port, encode(beat("n-a", runs=(run,))), "reader-token")[0] == 403
        status, detail = post(heartbeat_port, b'{"v": 1, "node": "n-a", "time_unix_s": "now"}', "agent-token")
        assert (status, b"time_unix_s" in detail) == (422, True)
        assert post(heartbeat_port, encode(beat("n-new", runs=(run,))), "agent-token")[0] == SEND_TO_API
        # an agent not yet rolled onto rotated tokens: its previous token is taken too
        assert post(heartbeat_port, encode(beat("n-new", runs=(run,))), "agent-token-before-rotation")[0] == SEND_TO_API
        too_large = b"POST /v1/heartbeat HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1)
        assert raw(heartbeat_port, too_large).startswith(b"HTTP/1.1 413 ")  # at once, the body not read
        assert raw(heartbeat_port, b"\x16\x03\x01 not HTTP\r\n\r\n").startswith(b"HTTP/1.1 400 ")
        wait_for(
            "the refusals counted",
            lambda: all(
                counters(port)[f"opsd_controller_rejected_requests_total{{{r}}}"] == 1
                for r in ("auth", "forbidden", "validation", "too_large", "malformed")
            ),
            10,
        )
        assert "n-new" not in controller.nodes  # sent back, not taken

        # the process killed: the replies stop naming its port, and the agent goes on with the API
        with caplog.at_level(logging.ERROR, logger="opsd.api.pipes"):
            os.kill(pid, 9)
            wait_for("the API to see its process gone", lambda: controller.heartbeat_port is None, 10)
            assert reporter.send_once(time.time())
            assert reporter.apart is None
            assert reporter.send_once(time.time())
            wait_for("the error logged", lambda: "the heartbeat process ended (exit status -9)" in caplog.text, 10)
    finally:
        reporter.stop()


@pytest.fixture
def api_and_apart() -> Iterator[tuple[StandIn, StandIn]]:
    """Two stand-ins: the API, whose replies name the other's port, and the heartbeat process."""
    api, apart = StandIn(token="agent-token"), StandIn(token="agent-token")
    api.reply = apart.reply = {"ack_events_up_to": 0, "heartbeat_port": apart.port}
    api.start()
    apart.start()
    try:
        yield api, apart
    finally:
        api.stop()
        apart.stop()


def test_the_agent_goes_back_to_the_api_for_what_the_process_sends_back(api_and_apart: tuple[StandIn, StandIn]) -> None:
    api, apart = api_and_apart
    reporter = Reporter(ReporterConfig(url=api.url, token="agent-token"), "n1", NodeState(), None)
    try:
        assert reporter.send_once(NOW_S)
        assert (len(api.requests), len(apart.requests)) == (1, 0)
        assert reporter.send_once(NOW_S + 1)
        assert (len(api.requests), len(apart.requests)) == (1, 1)
        apart.status = SEND_TO_API
        assert reporter.send_once(NOW_S + 2)  # sent back: the same heartbeat to the API
        assert (len(api.requests), len(apart.requests)) == (2, 2)
        assert api.requests[-1][1] == apart.requests[-1][1]
        assert reporter.sent_failed == 0
    finally:
        reporter.stop()


def test_the_agent_holds_off_a_process_it_cannot_reach(
    api_and_apart: tuple[StandIn, StandIn], monkeypatch: pytest.MonkeyPatch
) -> None:
    api, apart = api_and_apart
    reporter = Reporter(ReporterConfig(url=api.url, token="agent-token"), "n1", NodeState(), None)
    try:
        assert reporter.send_once(NOW_S)
        apart.stop()  # its port now refuses connections
        assert reporter.send_once(NOW_S + 1)  # to the API instead, delivered
        assert len(api.requests) == 2
        apart.start()
        assert reporter.send_once(NOW_S + 2)  # not tried again before the hold is over
        assert (len(api.requests), len(apart.requests)) == (3, 0)
        monkeypatch.setattr(reporter, "apart_hold_mono_s", time.monotonic())
        assert reporter.send_once(NOW_S + 3)
        assert (len(api.requests), len(apart.requests)) == (3, 1)
        assert 10 * reporter.config.interval_s <= reporter_module.APART_HOLD_S
        apart.stop()
        assert reporter.send_once(NOW_S + 4)  # refused again: held off again, to the API
        assert len(api.requests) == 4
        successor = StandIn(token="agent-token")  # a new leader, whose replies name its own process
        successor.reply = {"ack_events_up_to": 0, "heartbeat_port": successor.port}
        api.reply = successor.reply
        successor.start()
        try:
            assert reporter.send_once(NOW_S + 5)  # the API's reply names the new port
            assert reporter.send_once(NOW_S + 6)  # which is tried at once, hold or not
            assert (len(api.requests), len(successor.requests)) == (5, 1)
        finally:
            successor.stop()
    finally:
        reporter.stop()


def test_the_reply_schema_names_the_port() -> None:
    decoded = msgspec.json.decode(b'{"ack_events_up_to": 0, "heartbeat_port": 8471}', type=HeartbeatReply)
    assert decoded.heartbeat_port == 8471
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"ack_events_up_to": 0, "heartbeat_port": 0}', type=HeartbeatReply)


def test_the_process_is_told_what_changed_and_forgets_a_node_with_events(tmp_path: Path) -> None:
    controller = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"))
    controller.heartbeat_port = 8471
    told = Told()
    controller.heartbeat(beat("n1"), NOW_S)
    first = told.view(controller, {"n1", "n-unknown"})
    assert first is not None
    assert (first.heartbeat_port, first.policies, first.nodes, first.nodes_gone) == (
        8471,
        {"r1": EMPTY},
        {"n1": ("r1", 0)},
        [],
    )
    assert told.view(controller, {"n1"}) is None  # nothing changed
    controller.ask_checkpoint("r1", 40)
    assert told.view(controller, set()) == View(
        controller.telemetry.interval_s, None, 8471, {"r1": Policy(checkpoint_at_step=40)}, [], {}, []
    )
    controller.heartbeat(beat("n1", events=1), NOW_S + 1)  # a GPU event waiting for its incident: the API's alone
    gone = told.view(controller, {"n1"})
    assert gone is not None
    assert (gone.nodes, gone.nodes_gone) == ({}, ["n1"])


def test_a_port_taken_leaves_the_heartbeats_to_the_api(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    controller = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"))
    port = free_port()
    with caplog.at_level(logging.ERROR, logger="opsd.api.heartbeat_ingest"):
        server = start_api(controller, CREDENTIALS, "127.0.0.1", port, heartbeat_port=taken.getsockname()[1])
    try:
        assert "no heartbeat process on tcp" in caplog.text
        assert controller.heartbeat_port is None
        answer = request(port, "POST", "/v1/heartbeat", "agent-token", encode(beat("n1")))
        assert answer["heartbeat_port"] is None
        assert answer["liveness_port"] == controller.liveness_port  # the rest as ever
    finally:
        server.should_exit = True
        taken.close()


def process(parent_pid: int, settings: bytes) -> tuple[subprocess.Popen[bytes], list[int]]:
    """The heartbeat process started by hand on a listening socket: (it, the fds to close)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    views_read, views_write = os.pipe()
    batches_read, batches_write = os.pipe()
    command = [sys.executable, "-m", "opsd.api.heartbeat_worker", "--socket-fd", str(sock.fileno())]
    command += ["--in-fd", str(views_read), "--out-fd", str(batches_write), "--parent-pid", str(parent_pid)]
    passed = (sock.fileno(), views_read, batches_write)
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=passed)
    for fd in (views_read, batches_write):
        os.close(fd)
    assert proc.stdin is not None
    with proc.stdin:
        proc.stdin.write(settings)
    sock.close()
    return proc, [views_write, batches_read]


def test_the_process_ends_with_its_parent_and_refuses_bad_settings() -> None:
    settings = msgspec.msgpack.encode(WorkerConfig("op-token", agent="agent-token"))
    for parent_pid, data, status in ((1, settings, 0), (os.getpid(), b"\x93not settings", 2)):
        proc, fds = process(parent_pid, data)  # parent 1: not its parent, as if its parent had died
        try:
            assert proc.wait(20) == status
        finally:
            for fd in fds:
                os.close(fd)
    proc, fds = process(os.getpid(), msgspec.msgpack.encode(WorkerConfig("same", agent="same")))
    try:
        assert proc.wait(20) == 2  # two roles with one token: refused as the API refuses it
        assert proc.stderr is not None
        assert b"each role needs a token of its own" in proc.stderr.read()
    finally:
        for fd in fds:
            os.close(fd)
