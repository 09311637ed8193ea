"""The agent's OpenTelemetry spans reach an OTLP/HTTP endpoint (a real HTTP server decoding the protobuf)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from agent.daemon import Agent, AgentConfig
from opsd.backends.local.processes import free_port
from opsd.protocol.gpu_files import inject_xid
from tests.test_gpu_health import start_file_agent, wait_for_xids


@pytest.fixture
def collector() -> Iterator[tuple[str, list[tuple[str, str, bytes]]]]:
    received: list[tuple[str, str, bytes]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, self.headers["Content-Type"], body))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()


def test_xid_events_become_spans_over_otlp_http(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, collector: tuple[str, list[tuple[str, str, bytes]]]
) -> None:
    endpoint, received = collector
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    agent, gpus = start_file_agent(tmp_path, node="n3")
    try:
        inject_xid(gpus, 1, 79)
        wait_for_xids(agent, 1)
    finally:
        agent.stop()  # flushes the spans
    assert received, "no OTLP request arrived"
    path, content_type, body = received[0]
    assert path == "/v1/traces"
    assert content_type == "application/x-protobuf"
    request = ExportTraceServiceRequest.FromString(body)
    (resource_spans,) = request.resource_spans
    resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert resource["service.name"] == "opsd-agent"
    assert resource["host.name"] == "n3"
    (span,) = [s for scope in resource_spans.scope_spans for s in scope.spans]
    assert span.name == "gpu.xid"
    attributes = {a.key: a.value for a in span.attributes}
    assert attributes["gpu.index"].int_value == 1
    assert attributes["gpu.xid"].int_value == 79
    assert attributes["opsd.action"].string_value == "cordon_and_swap"


def test_without_an_endpoint_spans_are_noops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(variable, raising=False)
    agent = Agent(AgentConfig(socket=str(tmp_path / "a.sock"), metrics_port=0, node="n"))
    agent.start()
    try:
        assert agent.tracing is not None
        assert agent.tracing.provider is None
    finally:
        agent.stop()
