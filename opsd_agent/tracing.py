"""OpenTelemetry spans for the agent's events (GPU health events, policy changes), exported over OTLP/HTTP.

Enabled when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set; the exporter
reads the standard ``OTEL_EXPORTER_OTLP_*`` variables (headers, timeout, ...). Otherwise spans are no-ops.
"""

from __future__ import annotations

import logging
import os

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

log = logging.getLogger(__name__)

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


class Tracing:
    """The agent's tracer: a real provider with an OTLP/HTTP exporter when configured, else a no-op tracer."""

    def __init__(self, node: str, service_name: str = "opsd-agent") -> None:
        self.provider: TracerProvider | None = None
        if any(os.environ.get(v) for v in ENDPOINT_VARIABLES):
            resource = Resource.create({"service.name": service_name, "host.name": node})
            self.provider = TracerProvider(resource=resource)
            self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
            self.tracer = self.provider.get_tracer("opsd.agent")
            log.info("OpenTelemetry spans exported over OTLP/HTTP")
        else:
            self.tracer = trace.NoOpTracer()

    def shutdown(self) -> None:
        """Flush the spans still buffered, then stop exporting."""
        if self.provider is not None:
            self.provider.shutdown()
