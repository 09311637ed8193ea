"""The agent's HTTP endpoints: ``/metrics`` and ``/healthz``, and what ranks without the host directory ask of it
over the network (``opsd.protocol.node_agent``):

- ``GET /v1/policy``: the controller's policy as the policy file holds it (``{"v": 1}`` before the controller sent
  one, or without a controller);
- ``POST /v1/flight-recorder``: one rank's Flight Recorder dump (a JSON object naming its ``run``, ``trigger`` and
  ``rank``), written atomically to ``<flight_dir>/<run>/<trigger>/rank-<rank>.json``, where the uploader finds it as
  if the rank had written it (``agent.flight``). Answers 201; 400 for a body that is not a dump, 413 above
  ``MAX_DUMP_BYTES``, 503 when the agent keeps no dumps (no ``flight_dir``); counted by result in
  ``opsd_agent_flight_dumps_received_total``.

``/metrics`` needs ``Authorization: Bearer <metrics_token>`` when the agent has one (what Prometheus sends, from the
chart's Secret); the rest is open, as the ranks hold no credential: the agent's NetworkPolicy says who reaches it.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from opsd.protocol.node_agent import FLIGHT_PATH, MAX_DUMP_BYTES, POLICY_PATH, dump_path

log = logging.getLogger(__name__)

DUMP_RESULTS = ("ok", "rejected", "too_large")


class DumpIntake:
    """Dumps sent by ranks, kept in ``directory`` for the uploader; counted by result."""

    def __init__(self, directory: str | None) -> None:
        self.directory = Path(directory) if directory else None
        self.counts = dict.fromkeys(DUMP_RESULTS, 0)
        self._lock = threading.Lock()

    def count(self, result: str) -> None:
        with self._lock:
            self.counts[result] += 1

    def take(self, body: bytes) -> tuple[int, dict[str, Any]]:
        """Store one dump; the HTTP status and the answer."""
        if self.directory is None:
            return 503, {"detail": "this agent keeps no Flight Recorder dumps (agent.flight_dir is not set)"}
        if len(body) > MAX_DUMP_BYTES:
            self.count("too_large")
            return 413, {"detail": f"a dump is at most {MAX_DUMP_BYTES} bytes"}
        try:
            dump = json.loads(body)
            run, trigger, rank = dump["run"], dump["trigger"], dump["rank"]
            if not (isinstance(run, str) and run and isinstance(trigger, str) and trigger):
                raise ValueError("run and trigger must be non-empty strings")
            if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
                raise ValueError("rank must be an integer >= 0")
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            self.count("rejected")
            return 400, {"detail": f"not a Flight Recorder dump: {exc!s}"[:500]}
        relative = dump_path(run, trigger, rank)
        target = self.directory / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{threading.get_ident()}.tmp")
        tmp.write_bytes(body)
        os.replace(tmp, target)  # the uploader sees the whole file or none
        self.count("ok")
        log.info("flight dump of rank %d of run %s (%s) received: %s", rank, run, trigger, target)
        return 201, {"stored": str(relative)}


class DumpIntakeCollector(Collector):
    def __init__(self, intake: DumpIntake, node: str) -> None:
        self.intake = intake
        self.node = node

    def collect(self) -> Iterator[Metric]:
        received = CounterMetricFamily(
            "opsd_agent_flight_dumps_received",
            "Flight Recorder dumps ranks sent over HTTP: kept (ok), not a dump (rejected), over 64 MiB (too_large).",
            labels=["node", "result"],
        )
        for result in DUMP_RESULTS:
            received.add_metric([self.node, result], self.intake.counts[result])
        yield received


def handler(
    *,
    metrics: Callable[[], bytes],
    health: Callable[[], dict[str, Any]],
    policy: Callable[[], dict[str, Any] | None],
    intake: DumpIntake,
    metrics_token: str = "",
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                if metrics_token and not _bearer_ok(self.headers.get("Authorization"), metrics_token):
                    self._json(401, {"detail": "a valid bearer token is required"}, [("WWW-Authenticate", "Bearer")])
                    return
                self._reply(200, CONTENT_TYPE_LATEST, metrics())
            elif path == "/healthz":
                self._json(200, health())
            elif path == POLICY_PATH:
                self._json(200, {"v": 1, **(policy() or {})})
            else:
                self._json(404, {"detail": f"not found: /metrics, /healthz, {POLICY_PATH} are served"})

        def do_POST(self) -> None:
            if self.path.split("?", 1)[0] != FLIGHT_PATH:
                self._json(404, {"detail": f"not found: POST {FLIGHT_PATH} is served"})
                return
            try:
                length = int(self.headers.get("Content-Length") or "-1")
            except ValueError:
                length = -1
            if length < 0:
                self._json(411, {"detail": "Content-Length is required"})
                return
            if length > MAX_DUMP_BYTES:
                intake.count("too_large")
                self._json(413, {"detail": f"a dump is at most {MAX_DUMP_BYTES} bytes"})
                return
            status, answer = intake.take(self.rfile.read(length))
            self._json(status, answer)

        def _json(self, status: int, payload: Any, headers: list[tuple[str, str]] | None = None) -> None:
            self._reply(status, "application/json", json.dumps(payload).encode(), headers)

        def _reply(
            self, status: int, content_type: str, body: bytes, headers: list[tuple[str, str]] | None = None
        ) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for key, value in headers or []:
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("http: " + format, *args)

    return Handler


def _bearer_ok(authorization: str | None, token: str) -> bool:
    if not authorization or not authorization.startswith("Bearer "):
        return False
    return hmac.compare_digest(authorization.removeprefix("Bearer ").strip(), token)
