"""The agent's HTTP endpoints: ``/metrics`` and ``/healthz``, and what ranks without the host directory ask of it
over the network (``opsd.protocol.node_agent``):

- ``GET /v1/policy``: the controller's policy as the policy file holds it (``{"v": 1}`` before the controller sent
  one, or without a controller);
- ``POST /v1/flight-recorder``: one rank's Flight Recorder dump (a JSON object naming its ``run``, ``trigger`` and
  ``rank``), written atomically to ``<flight_dir>/<run>/<trigger>/rank-<rank>.json``, where the uploader finds it as
  if the rank had written it (``opsd_agent.flight``). Answers 201; 400 for a body that is not a dump, 413 above
  ``MAX_DUMP_BYTES``, 503 when the agent keeps no dumps (no ``flight_dir``) or is busy taking in ``UPLOAD_SLOTS``
  others (with ``Retry-After``); counted by result in ``opsd_agent_flight_dumps_received_total``. A dump is streamed
  to disk, never held whole in memory (``DumpIntake``).

``/metrics`` needs ``Authorization: Bearer <metrics_token>`` when the agent has one (what Prometheus sends, from the
chart's Secret; the previous token too, during a rotation). The policy and the dumps ask for the rank's run key
where the agent's ``rank_auth`` says (``opsd_agent.rank_gate``: 401 without it, or with a wrong one; 403 for a dump of
another run than the key's); ``/healthz`` is open.
"""

from __future__ import annotations

import hmac
import io
import json
import logging
import mmap
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from opsd.protocol.node_agent import (
    FLIGHT_PATH,
    MAX_DUMP_BYTES,
    POLICY_PATH,
    UPLOAD_SLOTS,
    UPLOAD_WAIT_S,
    DumpHeader,
    dump_path,
)
from opsd.protocol.policy_file import EMPTY, Policy, encode_policy
from opsd.protocol.rank_auth import RUN_HEADER, RankAuth
from opsd_agent.rank_gate import RankGate

log = logging.getLogger(__name__)

DUMP_RESULTS = ("ok", "rejected", "too_large", "busy")
CHUNK_BYTES = 1 << 20


class DumpIntake:
    """Dumps sent by ranks, kept in ``directory`` for the uploader; counted by result.

    A dump is streamed to a file beside where it lands, a chunk at a time, then read through a memory map for its
    header (``DumpHeader``: the rest is checked to be JSON, never built as objects), then renamed into place: an
    upload costs the agent a chunk of memory, not the dump's size five times over. At most ``slots`` are taken in at
    once; a further sender waits ``wait_s`` for a slot, then is answered 503 (``busy``) with ``Retry-After``."""

    def __init__(self, directory: str | None, slots: int = UPLOAD_SLOTS, wait_s: float = UPLOAD_WAIT_S) -> None:
        if slots < 1:
            raise ValueError("the agent takes at least one dump at a time")
        self.directory = Path(directory) if directory else None
        self.counts = dict.fromkeys(DUMP_RESULTS, 0)
        self.wait_s = wait_s
        self._slots = threading.BoundedSemaphore(slots)
        self._lock = threading.Lock()

    def count(self, result: str) -> None:
        with self._lock:
            self.counts[result] += 1

    def take(self, body: bytes) -> tuple[int, dict[str, Any]]:
        """Store one dump held in memory; the HTTP status and the answer."""
        return self.take_stream(io.BytesIO(body), len(body))

    def take_stream(self, stream: io.BufferedIOBase, length: int, run: str | None = None) -> tuple[int, dict[str, Any]]:
        """Store one dump of ``length`` bytes read from ``stream`` (``run``: only a dump of that run); the HTTP status
        and the answer."""
        if self.directory is None:
            return 503, {"detail": "this agent keeps no Flight Recorder dumps (agent.flight_dir is not set)"}
        if length > MAX_DUMP_BYTES:
            self.count("too_large")
            return 413, {"detail": f"a dump is at most {MAX_DUMP_BYTES} bytes"}
        if not self._slots.acquire(timeout=self.wait_s):
            self.count("busy")
            return 503, {"detail": "the agent is taking in other dumps: send it again", "retry_after_s": 1}
        try:
            return self._store(stream, length, self.directory, run)
        finally:
            self._slots.release()

    def _store(
        self, stream: io.BufferedIOBase, length: int, directory: Path, run: str | None
    ) -> tuple[int, dict[str, Any]]:
        directory.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=directory, prefix=".upload-", suffix=".tmp")
        tmp = Path(name)
        try:
            with os.fdopen(fd, "wb") as out:
                remaining = length
                while remaining:
                    chunk = stream.read(min(CHUNK_BYTES, remaining))
                    if not chunk:
                        raise ValueError(f"the body ended {remaining} bytes short of its Content-Length")
                    out.write(chunk)
                    remaining -= len(chunk)
            header = read_header(tmp)
        except (ValueError, OSError) as exc:
            tmp.unlink(missing_ok=True)
            self.count("rejected")
            return 400, {"detail": f"not a Flight Recorder dump: {exc!s}"[:500]}
        if run is not None and header.run != run:
            tmp.unlink(missing_ok=True)
            self.count("rejected")
            return 403, {"detail": "the dump is of another run than the key's", "refused": "other_run"}
        relative = dump_path(header.run, header.trigger, header.rank)
        target = directory / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, target)  # the uploader sees the whole file or none
        self.count("ok")
        log.info("flight dump of rank %d of run %s (%s) received: %s", header.rank, header.run, header.trigger, target)
        return 201, {"stored": str(relative)}


def read_header(path: Path) -> DumpHeader:
    """The header of the dump in ``path``, the file mapped rather than read; ``ValueError`` for one that is not a dump
    (not JSON, not an object, or without a valid run, trigger or rank)."""
    with path.open("rb") as file:
        if os.fstat(file.fileno()).st_size == 0:
            raise ValueError("the body is empty")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as view:
            try:
                return msgspec.json.decode(view, type=DumpHeader)
            except msgspec.DecodeError as exc:  # ValidationError is one
                raise ValueError(str(exc)) from None


class DumpIntakeCollector(Collector):
    def __init__(self, intake: DumpIntake, node: str) -> None:
        self.intake = intake
        self.node = node

    def collect(self) -> Iterator[Metric]:
        received = CounterMetricFamily(
            "opsd_agent_flight_dumps_received",
            "Flight Recorder dumps ranks sent over HTTP: kept (ok), not a dump (rejected), over 64 MiB (too_large), "
            "refused while the agent took in others for longer than the sender may wait (busy).",
            labels=["node", "result"],
        )
        for result in DUMP_RESULTS:
            received.add_metric([self.node, result], self.intake.counts[result])
        yield received


def handler(
    *,
    metrics: Callable[[], bytes],
    health: Callable[[], dict[str, Any]],
    policy: Callable[[], Policy | None],
    intake: DumpIntake,
    gate: RankGate,
    metrics_tokens: tuple[str, ...] = (),
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = 60  # a sender that stops mid-body gives its upload slot back (its dump is rejected)

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                if metrics_tokens and not _bearer_ok(self.headers.get("Authorization"), metrics_tokens):
                    self._json(401, {"detail": "a valid bearer token is required"}, [("WWW-Authenticate", "Bearer")])
                    return
                self._reply(200, CONTENT_TYPE_LATEST, metrics())
            elif path == "/healthz":
                self._json(200, health())
            elif path == POLICY_PATH:
                if not self._refused("policy"):
                    self._reply(200, "application/json", encode_policy(policy() or EMPTY))
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
            if self._refused("flight_recorder"):
                return
            if length > MAX_DUMP_BYTES:
                intake.count("too_large")
                self._json(413, {"detail": f"a dump is at most {MAX_DUMP_BYTES} bytes"})
                return
            signed = gate.mode is not RankAuth.OFF and self.headers.get("Authorization")
            status, answer = intake.take_stream(self.rfile, length, self.headers.get(RUN_HEADER) if signed else None)
            if answer.get("refused"):
                gate.count_refused(answer["refused"])
            retry = [("Retry-After", str(answer["retry_after_s"]))] if "retry_after_s" in answer else None
            self._json(status, answer, retry)

        def _refused(self, endpoint: str) -> bool:
            """Whether the request is refused for its run's key (and answered 401)."""
            reason = gate.refuses_request(self.headers.get("Authorization"), self.headers.get(RUN_HEADER), endpoint)
            if reason is None:
                return False
            self.close_connection = True  # its body, if any, is not read
            detail = "the run's key is required" if reason == "unsigned" else "not the key of the run named"
            self._json(401, {"detail": detail, "refused": reason}, [("WWW-Authenticate", "Bearer")])
            return True

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


def _bearer_ok(authorization: str | None, tokens: tuple[str, ...]) -> bool:
    """Whether the header carries one of ``tokens`` (each compared in constant time; "" is no token)."""
    if not authorization or not authorization.startswith("Bearer "):
        return False
    presented = authorization.removeprefix("Bearer ").strip().encode()
    return sum(hmac.compare_digest(presented, token.encode()) for token in tokens if token) > 0
