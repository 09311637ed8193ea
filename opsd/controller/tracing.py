"""Every incident as one OpenTelemetry trace, exported over OTLP/HTTP (docs/tracing.md).

Enabled when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set; the exporter reads
the standard ``OTEL_EXPORTER_OTLP_*`` variables (headers, timeout, ...), the resource ``OTEL_RESOURCE_ATTRIBUTES``,
and its ``service.name`` is ``opsd-controller``. Otherwise nothing is built, assigned or exported.

An incident is given its trace id when it is opened (kept in the state store, so that a controller that takes the
recovery up exports under the same id, and the post-mortem shows it). Its trace is built once the incident ends,
from what the store recorded, with the recorded times: the root span ``incident`` from detection to the first
productive step, a child per recovery step in the order they were done (each from the end of the one before, the
first from detection, to when it was recorded done), then ``resume`` from the relaunch to the first productive
step; so the children's durations add up to the recovery time. A recovery that fails ends its trace there, with an
error status. The agent's span of the GPU event that caused the incident, when it sent one, is a link of the root.

Tracing never raises into the controller, nor blocks it: spans are queued and exported by a thread of the SDK's;
what cannot be built or exported is logged and counted (``errors``, ``opsd_controller_trace_errors_total``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import Link, SpanContext, Status, StatusCode, TraceFlags
from opentelemetry.util.types import AttributeValue

from opsd.controller.state import StateStore
from opsd.protocol.records import Action, IncidentRow
from opsd.protocol.states import ActionKind, ActionState

log = logging.getLogger(__name__)

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
SERVICE_NAME = "opsd-controller"
ROOT_SPAN = "incident"
RESUME_SPAN = "resume"
#: the span of each recovery step
STEP_SPANS = {
    ActionKind.CHECKPOINT: "checkpoint",
    ActionKind.DUMP: "dump",
    ActionKind.CORDON: "quarantine",
    ActionKind.TAKE_SPARE: "promote_spare",
    ActionKind.STOP: "stop",
    ActionKind.LAUNCH: "relaunch",
}
RESULT_MAX_CHARS = 2000  # a step's result, as JSON text in ``opsd.result``, is cut here


class _IncidentIds(RandomIdGenerator):
    """Random ids, but the trace id of the incident whose root span is being started (set under the lock)."""

    def __init__(self) -> None:
        self.trace_id: int | None = None

    def generate_trace_id(self) -> int:
        return self.trace_id if self.trace_id is not None else self.random_trace_id()

    def random_trace_id(self) -> int:
        return super().generate_trace_id()


class _CountedExporter(SpanExporter):
    """The OTLP exporter, its failures counted (the SDK's export thread only logs them)."""

    def __init__(self, exporter: SpanExporter, tracing: IncidentTracing) -> None:
        self.exporter = exporter
        self.tracing = tracing

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.exporter.export(spans)
        except Exception:
            log.exception("the export of %d spans failed", len(spans))
            result = SpanExportResult.FAILURE
        if result is not SpanExportResult.SUCCESS:
            self.tracing.failed("export")
        return result

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self.exporter.force_flush(timeout_millis)


class IncidentTracing:
    """The controller's incident traces: a tracer provider with an OTLP/HTTP exporter, or nothing (``enabled``)."""

    def __init__(self, exporter: SpanExporter | None = None) -> None:
        self.errors: dict[str, int] = {"build": 0, "export": 0}  # traces that could not be built, exports that failed
        self._errors_lock = threading.Lock()
        self._lock = threading.Lock()  # one root span started at a time (the id generator hands it its trace id)
        self._ids = _IncidentIds()
        self.provider: TracerProvider | None = None
        if exporter is not None:
            resource = Resource.create({"service.name": SERVICE_NAME})
            self.provider = TracerProvider(resource=resource, id_generator=self._ids)
            self.provider.add_span_processor(BatchSpanProcessor(_CountedExporter(exporter, self)))
            self._tracer = self.provider.get_tracer("opsd.controller")

    @classmethod
    def from_environment(cls) -> IncidentTracing:
        """Exporting over OTLP/HTTP when an endpoint variable is set, else disabled."""
        if not any(os.environ.get(v) for v in ENDPOINT_VARIABLES):
            return cls()
        log.info("incident traces exported over OTLP/HTTP (service.name %s)", SERVICE_NAME)
        return cls(OTLPSpanExporter())

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def failed(self, stage: str) -> None:
        with self._errors_lock:
            self.errors[stage] = self.errors.get(stage, 0) + 1

    def new_trace_id(self) -> str | None:
        """A trace id for a new incident (None when disabled)."""
        if not self.enabled:
            return None
        return trace.format_trace_id(self._ids.random_trace_id())

    def assign(self, store: StateStore, incident_id: int, **ids: str) -> None:
        """Record a new incident's trace id (when enabled) and ``ids`` (the agent's span of the GPU event that caused
        it: ``gpu_trace_id``, ``gpu_span_id``); never raises."""
        trace_id = self.new_trace_id()
        if trace_id is not None:
            ids["trace_id"] = trace_id
        if not ids:
            return
        try:
            store.update_incident(incident_id, **ids)
        except Exception:
            self.failed("build")
            log.exception("incident %d: its trace ids could not be recorded", incident_id)

    def trace(self, store: StateStore, incident_id: int, *, ended_s: float | None = None, error: str = "") -> None:
        """Export the trace of incident ``incident_id`` as the store has it: recovered (its ``resumed_s``), or failed
        at ``ended_s`` with ``error``. Nothing when disabled; never raises."""
        if not self.enabled:
            return
        try:
            incident = store.incident(incident_id)
            if incident is None:
                return
            trace_id = incident.trace_id or ""
            if not _is_hex(trace_id, 32):  # opened by a controller that did not trace, or an earlier version
                trace_id = self.new_trace_id() or ""
                store.update_incident(incident_id, trace_id=trace_id)
            self.export(incident, store.actions(incident_id=incident_id), int(trace_id, 16), ended_s, error)
        except Exception:
            self.failed("build")
            log.exception("incident %d: its trace could not be built", incident_id)

    def export(
        self,
        incident: IncidentRow,
        actions: Sequence[Action],
        trace_id: int,
        ended_s: float | None = None,
        error: str = "",
    ) -> None:
        """Build the incident's spans with their recorded times and queue them for export."""
        detected_s = incident.detected_s
        resumed_s = incident.resumed_s
        end_s = max(detected_s, float(resumed_s) if resumed_s is not None else (ended_s or detected_s))

        def at(t: float | None) -> int:  # within the root span, in ns
            return int(min(max(detected_s, t if t is not None else end_s), end_s) * 1e9)

        common = _common(incident)
        root_attributes = {
            **common,
            "opsd.run": incident.run,
            "opsd.incident.id": incident.id,
            "opsd.incident.kind": str(incident.kind),
            "opsd.detail": incident.detail,
            "opsd.detection_delay_s": detected_s - incident.failed_s,
            "opsd.result": "recovered" if resumed_s is not None else f"failed: {error}" if error else "not recovered",
        }
        for key in ("spare", "resumed_from_step", "lost_steps"):
            value = getattr(incident, key)
            if value is not None:
                root_attributes[f"opsd.{key}"] = value
        with self._lock:
            self._ids.trace_id = trace_id
            try:
                root = self._tracer.start_span(
                    ROOT_SPAN, start_time=at(detected_s), attributes=root_attributes, links=_cause_links(incident)
                )
            finally:
                self._ids.trace_id = None
        parent = trace.set_span_in_context(root)
        previous_s = detected_s
        for action in sorted(actions, key=lambda a: a.seq):
            done = action.state == ActionState.DONE
            start = max(previous_s, action.created_s)
            span = self._tracer.start_span(
                STEP_SPANS.get(action.kind, str(action.kind)),
                context=parent,
                start_time=at(start),
                attributes={**common, **_step_attributes(action)},
            )
            if not done:
                span.set_status(Status(StatusCode.ERROR, error or "not done"))
            span.end(end_time=at(action.done_s if done else end_s))
            if done and action.done_s is not None:
                previous_s = max(previous_s, action.done_s)
        if resumed_s is not None:
            step = incident.resumed_from_step
            resume = self._tracer.start_span(
                RESUME_SPAN,
                context=parent,
                start_time=at(previous_s),
                attributes={
                    **common,
                    "opsd.result": "first productive step"
                    + (f" after restoring step {step}" if step is not None else ""),
                },
            )
            resume.end(end_time=at(resumed_s))
        root.set_status(Status(StatusCode.OK) if resumed_s is not None else Status(StatusCode.ERROR, error or None))
        root.end(end_time=at(end_s))
        log.info("incident %d: trace %032x queued for export", incident.id, trace_id)

    def shutdown(self) -> None:
        """Export the spans still queued, then stop (the controller stops)."""
        if self.provider is None:
            return
        try:
            self.provider.shutdown()
        except Exception:
            self.failed("export")
            log.exception("the incident traces could not be flushed")


def _common(incident: IncidentRow) -> dict[str, AttributeValue]:
    """What every span of an incident carries: the node it failed on, and its rank when one is named."""
    out: dict[str, AttributeValue] = {"opsd.node": incident.node or ""}
    if incident.rank is not None:
        out["opsd.rank"] = incident.rank
    return out


def _step_attributes(action: Action) -> dict[str, AttributeValue]:
    result = action.result or {}
    out: dict[str, AttributeValue] = {
        "opsd.request_id": action.request_id,
        "opsd.step": str(action.kind),
        "opsd.state": str(action.state),
        "opsd.result": json.dumps(result, sort_keys=True, default=str)[:RESULT_MAX_CHARS],
    }
    if action.kind == ActionKind.TAKE_SPARE and result.get("spare"):
        out["opsd.spare"] = str(result["spare"])
    nodes = result.get("nodes")
    if action.kind == ActionKind.LAUNCH and isinstance(nodes, list):
        out["opsd.nodes"] = [str(n) for n in nodes]
    return out


def _cause_links(incident: IncidentRow) -> list[Link]:
    """A link to the agent's span of the GPU event that caused the incident, when it sent one."""
    trace_id, span_id = incident.gpu_trace_id or "", incident.gpu_span_id or ""
    if not (_is_hex(trace_id, 32) and _is_hex(span_id, 16)):
        return []
    context = SpanContext(
        int(trace_id, 16), int(span_id, 16), is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED)
    )
    return [Link(context, {"opsd.link": "caused_by"})]


def _is_hex(value: str, digits: int) -> bool:
    """A non-zero id of ``digits`` lower-case hex digits."""
    return len(value) == digits and all(c in "0123456789abcdef" for c in value) and int(value, 16) != 0
