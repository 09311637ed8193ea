"""Heartbeats to a real (small) HTTP controller, retries and the bounded buffer, and the policy back to the ranks."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from opsd.backends.local.processes import free_port
from opsd.policy.xid import WatchWindow
from opsd.protocol.policy_file import EMPTY, Policy
from opsd.protocol.wire import encode
from opsd.protocol.xid_table import load_xid_table
from opsd_agent.daemon import Agent, AgentConfig
from opsd_agent.gpu import FileGpuSource
from opsd_agent.health import GpuHealth
from opsd_agent.metrics import ReporterCollector
from opsd_agent.reporter import Reporter, ReporterConfig, backoff_s
from opsd_agent.state import NodeState
from tests.test_agent import step
from tests.test_wire import report
from tests.waiting import wait_for
from trainer_hooks.policy_reader import PolicyReader


class Controller:
    """A stand-in controller: records each heartbeat, answers with ``reply`` (or ``status``), checks the token."""

    def __init__(self, token: str = "s3cret") -> None:
        self.requests: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.reply: dict[str, Any] = {"ack_events_up_to": 0}
        self.raw_reply: bytes | None = None  # sent as it is, instead of ``reply``
        self.status = 200
        self.token = token
        self.port = free_port()
        self.server: ThreadingHTTPServer | None = None

    def start(self) -> None:
        controller = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                controller.requests.append((dict(self.headers), body))
                status = controller.status
                if self.headers.get("Authorization") != f"Bearer {controller.token}":
                    status = 401
                data = controller.raw_reply or json.dumps(controller.reply).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/heartbeat"


@pytest.fixture
def controller() -> Iterator[Controller]:
    c = Controller()
    c.start()
    try:
        yield c
    finally:
        c.stop()


def reporter(tmp_path: Path, url: str, token: str = "s3cret", **config: Any) -> Reporter:
    state = NodeState()
    state.ingest(step(rank=0, step=41), now_s=1.0)
    state.ingest(step(rank=1, step=42, resumed_from_step=40), now_s=2.0)
    gpu = GpuHealth(FileGpuSource(tmp_path / "gpus"), load_xid_table(), WatchWindow())
    cfg = ReporterConfig(url=url, token=token, policy_path=str(tmp_path / "policy.json"), **config)
    return Reporter(cfg, "node-7", state, gpu)


def test_heartbeat_carries_identity_ranks_and_events(tmp_path: Path, controller: Controller) -> None:
    r = reporter(tmp_path, controller.url)
    assert r.gpu is not None
    r.gpu.record(3, 79, now_s=5.0)
    assert r.send_once(now_s=10.0)
    headers, body = controller.requests[0]
    assert headers["Authorization"] == "Bearer s3cret"
    assert headers["Content-Type"] == "application/json"
    assert body["v"] == 1
    assert body["node"] == "node-7"
    assert [(x["rank"], x["step"], x["last_report_unix_s"]) for x in body["ranks"]] == [(0, 41, 1.0), (1, 42, 2.0)]
    assert [x["resumed_from_step"] for x in body["ranks"]] == [None, 40]  # as the rank's reports say
    assert [(e["gpu"], e["xid"], e["action"]) for e in body["events"]] == [(3, 79, "cordon_and_swap")]
    assert len(body["summaries"]) == 1
    assert body["summaries"][0]["ranks"] == 2


def test_events_are_resent_until_acknowledged(tmp_path: Path, controller: Controller) -> None:
    r = reporter(tmp_path, controller.url)
    assert r.gpu is not None
    first = r.gpu.record(0, 48, now_s=1.0)
    r.send_once(now_s=2.0)
    r.send_once(now_s=3.0)
    assert [len(b["events"]) for _, b in controller.requests] == [1, 1]
    controller.reply = {"ack_events_up_to": first.seq}
    r.send_once(now_s=4.0)  # acknowledged by this reply
    r.send_once(now_s=5.0)
    assert [len(b["events"]) for _, b in controller.requests] == [1, 1, 1, 0]


BAD_REPLIES = {
    "not JSON": b"<html>proxy error</html>",
    "another policy version": b'{"ack_events_up_to": 0, "policy": {"v": 2}, "telemetry_interval_s": 1.0}',
    "an interval of the wrong type": b'{"ack_events_up_to": 0, "telemetry_interval_s": "10"}',
    "no acknowledgement": b'{"telemetry_interval_s": 1.0}',
}


@pytest.mark.parametrize("body", BAD_REPLIES.values(), ids=BAD_REPLIES.keys())
def test_a_reply_that_does_not_fit_is_counted_and_changes_nothing(
    tmp_path: Path, controller: Controller, body: bytes
) -> None:
    """Delivered (the controller has the heartbeat), but nothing in the reply is applied: the policy, the interval and
    the ports the last good reply set stay."""
    r = reporter(tmp_path, controller.url)
    controller.reply = {"ack_events_up_to": 0, "telemetry_interval_s": 10.0, "policy": {"checkpoint_at_step": 8}}
    assert r.send_once(now_s=1.0)
    good = (r.telemetry_interval_s, r.last_policy, (tmp_path / "policy.json").read_bytes())
    controller.raw_reply = body
    assert r.send_once(now_s=2.0)
    assert (r.sent_ok, r.sent_failed, r.failures, r.replies_refused) == (2, 0, 0, 1)
    assert (r.telemetry_interval_s, r.last_policy, (tmp_path / "policy.json").read_bytes()) == good
    assert good[1] == Policy(checkpoint_at_step=8)
    families = {f.name: f for f in ReporterCollector(r, "node-7").collect()}
    assert [s.value for s in families["opsd_agent_replies_refused"].samples if s.name.endswith("_total")] == [1]


def test_unreachable_controller_buffers_summaries_oldest_dropped(tmp_path: Path, controller: Controller) -> None:
    url = controller.url
    controller.stop()
    r = reporter(tmp_path, url, max_summaries=3, timeout_s=1.0)
    for t in range(5):
        assert not r.send_once(now_s=float(t))
    assert (r.sent_failed, r.failures, r.summaries_dropped) == (5, 5, 2)
    assert [s.time_unix_s for s in r.summaries] == [2.0, 3.0, 4.0]
    controller.start()  # back, on the same port
    r.config = ReporterConfig(url=controller.url, token="s3cret", max_summaries=3)
    assert r.send_once(now_s=5.0)
    (_, body) = controller.requests[-1]
    assert [s["time_unix_s"] for s in body["summaries"]] == [3.0, 4.0, 5.0]
    assert body["summaries_dropped_total"] == 3
    assert r.failures == 0
    assert len(r.summaries) == 0


def test_wrong_token_is_a_failed_delivery(tmp_path: Path, controller: Controller) -> None:
    r = reporter(tmp_path, controller.url, token="wrong")
    assert not r.send_once(now_s=1.0)
    assert r.sent_failed == 1
    assert len(r.summaries) == 1  # kept for the next attempt


@pytest.mark.parametrize(
    ("failures", "jitter", "expected"),
    [(0, 0.9, 1.0), (1, 0.5, 2.0), (3, 0.5, 8.0), (3, 0.0, 4.0), (3, 1.0, 12.0), (10, 0.5, 30.0), (10, 1.0, 30.0)],
    ids=["ok", "one", "three", "three-low-jitter", "three-high-jitter", "capped", "capped-jitter"],
)
def test_backoff(failures: int, jitter: float, expected: float) -> None:
    assert backoff_s(failures, interval_s=1.0, cap_s=30.0, jitter_ratio=jitter) == expected


def test_policy_reply_reaches_the_ranks_through_the_file(tmp_path: Path, controller: Controller) -> None:
    r = reporter(tmp_path, controller.url)
    ticks = [0.0]
    reader = PolicyReader(str(tmp_path / "policy.json"), check_every_s=1.0, clock=lambda: ticks[0])
    assert reader.current() == EMPTY  # no file yet
    controller.reply = {
        "ack_events_up_to": 0,
        "policy": {
            "checkpoint": {"every_steps": 50, "from_step": 200},
            "commands": [{"id": "c1", "name": "dump_flight_recorder", "ranks": [1]}],
        },
    }
    r.send_once(now_s=1.0)
    ticks[0] = 2.0
    policy = reader.current()
    assert [s for s in range(0, 400) if policy.checkpoint_due(s)] == [200, 250, 300, 350]
    assert reader.new_commands(rank=0) == []
    assert [c.name for c in reader.new_commands(rank=1)] == ["dump_flight_recorder"]
    assert reader.new_commands(rank=1) == []  # once


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"url": "ftp://x"}, "http:// or https://"),
        ({"interval_s": 0}, "interval_s must be > 0"),
        ({"max_summaries": 0}, "max_summaries must be >= 1"),
        ({"interval_s": 60, "max_backoff_s": 30}, "max_backoff_s must be >= interval_s"),
    ],
    ids=["scheme", "interval", "buffer", "backoff"],
)
def test_reporter_config_validates_itself(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ReporterConfig(**{"url": "http://c/v1/heartbeat", **config})


def test_agent_sends_heartbeats_with_what_ranks_report(tmp_path: Path, controller: Controller) -> None:
    config = AgentConfig(
        socket=str(tmp_path / "a.sock"),
        metrics_port=0,
        node="n1",
        controller_url=controller.url,
        controller_token="s3cret",
        heartbeat_interval_s=0.1,
    )
    agent = Agent(config)
    agent.start()
    try:
        agent.handle(encode(report(rank=2, step=9)))
        wait_for("heartbeat with the rank's step", lambda: any(b["ranks"] for _, b in controller.requests), 10)
        text = agent.metrics_text().decode()
    finally:
        agent.stop()
    body = next(b for _, b in controller.requests if b["ranks"])
    assert [(x["rank"], x["step"]) for x in body["ranks"]] == [(2, 9)]
    assert 'opsd_agent_heartbeats_total{node="n1",result="ok"}' in text
