"""A local OTLP/HTTP trace receiver for tests: a real HTTP server on loopback that takes ``POST /v1/traces`` as an
OpenTelemetry collector does and decodes each body (``ExportTraceServiceRequest``, protobuf) into spans."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from opsd.backends.local.processes import free_port


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # its resource's service.name
    name: str
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    links: tuple[tuple[str, str, dict[str, Any]], ...]  # (trace id, span id, attributes)
    status_code: int  # 0 unset, 1 ok, 2 error

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def value_of(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value_of(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def attributes_of(items: Any) -> dict[str, Any]:
    return {a.key: value_of(a.value) for a in items}


class OtlpReceiver:
    """``url`` is the base endpoint (what ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set to); ``requests`` every POST as
    (path, content type, body); ``status`` the HTTP status it answers (400: it refuses every export)."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.requests: list[tuple[str, str, bytes]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.requests.append((self.path, self.headers["Content-Type"], body))
                self.send_response(receiver.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> OtlpReceiver:
        threading.Thread(target=self.server.serve_forever, name="otlp-receiver", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def spans(self) -> list[ReceivedSpan]:
        """Every span received, in the order they came."""
        out = []
        for path, content_type, body in self.requests:
            assert (path, content_type) == ("/v1/traces", "application/x-protobuf"), (path, content_type)
            for resource_spans in ExportTraceServiceRequest.FromString(body).resource_spans:
                service = attributes_of(resource_spans.resource.attributes).get("service.name", "")
                for scope in resource_spans.scope_spans:
                    for s in scope.spans:
                        links = tuple(
                            (link.trace_id.hex(), link.span_id.hex(), attributes_of(link.attributes))
                            for link in s.links
                        )
                        out.append(
                            ReceivedSpan(
                                service=service,
                                name=s.name,
                                trace_id=s.trace_id.hex(),
                                span_id=s.span_id.hex(),
                                parent_span_id=s.parent_span_id.hex(),
                                start_ns=s.start_time_unix_nano,
                                end_ns=s.end_time_unix_nano,
                                attributes=attributes_of(s.attributes),
                                links=links,
                                status_code=s.status.code,
                            )
                        )
        return out
