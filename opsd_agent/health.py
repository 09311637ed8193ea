"""The node's GPU health: samples and XID events from a ``GpuSource``, XID counters, and what each event means.

A thread polls the source every ``interval_s``. Each XID event increments a real counter per (gpu, xid) and is
classified by ``opsd.policy.xid``; events that call for an action (cordon and swap, restart) are kept, in order,
for the controller (``pending_events``) until it acknowledges them. Prometheus metrics come from
``GpuHealthCollector``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterator

from opentelemetry import trace
from opentelemetry.trace import Span, Tracer
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from opsd.errors import OpsError
from opsd.policy.xid import WatchWindow, XidDecision, XidEvent, decide
from opsd.protocol.gpu_files import GpuSample
from opsd.protocol.heartbeat import HeartbeatEvent
from opsd.protocol.xid_table import COUNTED, XidAction
from opsd_agent.gpu import GpuSource

log = logging.getLogger(__name__)


class GpuHealth:
    def __init__(
        self,
        source: GpuSource,
        table: dict[int, XidAction],
        window: WatchWindow,
        *,
        interval_s: float = 5.0,
        max_history: int = 10_000,
        tracer: Tracer | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("gpu.interval_s must be > 0")
        self.source = source
        self.table = table
        self.window = window
        self.interval_s = interval_s
        self.samples: list[GpuSample] = []
        self.xid_counts: dict[tuple[int, int], int] = {}
        self.action_counts: dict[tuple[int, str], int] = {}
        self.source_errors = 0
        self.tracer: Tracer = tracer or trace.NoOpTracer()
        self._history: deque[XidEvent] = deque(maxlen=max_history)
        self._pending: list[HeartbeatEvent] = []
        self._seq = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def record(self, gpu: int, xid: int, now_s: float) -> HeartbeatEvent:
        """Count one XID event and decide what it means."""
        event = XidEvent(gpu=gpu, xid=xid, time_s=now_s)
        # an event, not a duration: the span marks when it was seen; its ids go to the controller with the event
        span = self.tracer.start_span("gpu.xid", attributes={"gpu.index": gpu, "gpu.xid": xid})
        ids = span_ids(span)
        with self._lock:
            decision: XidDecision | None = decide(event, self._history, self.table, self.window)
            self._history.append(event)
            self.xid_counts[(gpu, xid)] = self.xid_counts.get((gpu, xid), 0) + 1
            self._seq += 1
            action = decision.action.value if decision else COUNTED
            reason = decision.reason if decision else f"xid {xid} counted ({self.window.threshold} allowed per window)"
            trace_id, span_id = ids
            health = HeartbeatEvent(
                seq=self._seq,
                gpu=gpu,
                xid=xid,
                time_s=now_s,
                action=action,
                reason=reason,
                trace_id=trace_id,
                span_id=span_id,
            )
            if decision is not None:
                self.action_counts[(gpu, action)] = self.action_counts.get((gpu, action), 0) + 1
                self._pending.append(health)
        span.set_attributes({"opsd.action": action, "opsd.reason": reason})
        span.end()
        if decision is not None:
            log.warning("gpu %d xid %d: %s (%s)", gpu, xid, action, reason)
        else:
            log.info("gpu %d xid %d counted", gpu, xid)
        return health

    def pending_events(self) -> list[HeartbeatEvent]:
        with self._lock:
            return list(self._pending)

    def acknowledge(self, up_to_seq: int) -> None:
        """The controller has these events: forget them."""
        with self._lock:
            self._pending = [e for e in self._pending if e.seq > up_to_seq]

    def poll_once(self, timeout_s: float, *, sample: bool = True) -> None:
        """Take a sample (unless told not to), then wait up to ``timeout_s`` for XID events."""
        try:
            if sample:
                samples = self.source.sample()
                with self._lock:
                    self.samples = samples
            for gpu, xid in self.source.xid_events(timeout_s):
                self.record(gpu, xid, time.time())
        except OpsError as exc:
            self.source_errors += 1
            log.warning("gpu source failed: %s", exc)
            self._stop.wait(timeout_s)

    def start(self) -> None:
        def loop() -> None:
            next_sample = 0.0
            while not self._stop.is_set():
                now = time.monotonic()
                due = now >= next_sample
                if due:
                    next_sample = now + self.interval_s
                # XID events are awaited in short slices so that stop() is prompt
                self.poll_once(min(0.5, max(next_sample - now, 0.01)), sample=due)

        self._thread = threading.Thread(target=loop, name="opsd-agent-gpu", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.source.close()


def span_ids(span: Span) -> tuple[str, str]:
    """A span's (trace id, span id) in W3C hex; ("", "") for a span that is not recorded (no exporter)."""
    context = span.get_span_context()
    if not context.is_valid:
        return "", ""
    return trace.format_trace_id(context.trace_id), trace.format_span_id(context.span_id)


def _add(family: GaugeMetricFamily | CounterMetricFamily, labels: list[str], value: float | None) -> None:
    if value is not None:
        family.add_metric(labels, float(value))


# sample field -> (metric, help)
_GAUGES = {
    "temperature_c": ("opsd_gpu_temperature_celsius", "GPU core temperature."),
    "sm_clock_hz": ("opsd_gpu_sm_clock_hertz", "SM clock."),
    "power_w": ("opsd_gpu_power_watts", "Power draw."),
    "clock_event_reasons": ("opsd_gpu_clock_event_reasons", "NVML bitmask of why clocks are held down (0: none)."),
    "row_remap_pending": ("opsd_gpu_row_remap_pending", "1 when a row remapping waits for a GPU reset."),
}


class GpuHealthCollector(Collector):
    def __init__(self, health: GpuHealth, node: str) -> None:
        self.health = health
        self.node = node

    def collect(self) -> Iterator[Metric]:
        h = self.health
        with h._lock:
            samples = list(h.samples)
            xids = dict(h.xid_counts)
            actions = dict(h.action_counts)
        gauges = {f: GaugeMetricFamily(name, text, labels=["gpu"]) for f, (name, text) in _GAUGES.items()}
        ecc = CounterMetricFamily(
            "opsd_gpu_ecc_errors", "ECC errors counted by the GPU.", labels=["gpu", "type", "scope"]
        )
        retired = GaugeMetricFamily("opsd_gpu_retired_pages", "Pages retired, by cause.", labels=["gpu", "cause"])
        remapped = GaugeMetricFamily("opsd_gpu_remapped_rows", "Memory rows remapped, by kind.", labels=["gpu", "kind"])
        nvlink = CounterMetricFamily("opsd_gpu_nvlink_errors", "NVLink CRC, replay, recovery errors.", labels=["gpu"])
        for s in samples:  # a field the GPU does not support (None) has no sample: not a 0
            g = str(s.index)
            for f, gauge in gauges.items():
                _add(gauge, [g], getattr(s, f))
            _add(ecc, [g, "corrected", "volatile"], s.ecc_volatile_corrected)
            _add(ecc, [g, "uncorrected", "volatile"], s.ecc_volatile_uncorrected)
            _add(ecc, [g, "corrected", "aggregate"], s.ecc_aggregate_corrected)
            _add(ecc, [g, "uncorrected", "aggregate"], s.ecc_aggregate_uncorrected)
            _add(retired, [g, "single_bit"], s.retired_pages_sbe)
            _add(retired, [g, "double_bit"], s.retired_pages_dbe)
            _add(remapped, [g, "correctable"], s.remapped_rows_correctable)
            _add(remapped, [g, "uncorrectable"], s.remapped_rows_uncorrectable)
            _add(nvlink, [g], s.nvlink_errors)
        field_errors = CounterMetricFamily(
            "opsd_gpu_field_errors",
            "Failed reads of a GPU health field (NVML NotSupported or another NVML error); the field is not exported.",
            labels=["gpu", "field"],
        )
        for (gpu, field), n in sorted(dict(getattr(h.source, "field_errors", {})).items()):
            field_errors.add_metric([str(gpu), field], n)
        yield from gauges.values()
        yield from (ecc, retired, remapped, nvlink, field_errors)
        xid = CounterMetricFamily("opsd_gpu_xid_errors", "XID events, by GPU and code.", labels=["gpu", "xid"])
        for (gpu, code), n in sorted(xids.items()):
            xid.add_metric([str(gpu), str(code)], n)
        yield xid
        act = CounterMetricFamily(
            "opsd_gpu_health_actions", "XID events that call for an action, by action.", labels=["gpu", "action"]
        )
        for (gpu, action), n in sorted(actions.items()):
            act.add_metric([str(gpu), action], n)
        yield act
        errors = CounterMetricFamily("opsd_gpu_source_errors", "Failures reading the GPU source.", labels=["node"])
        errors.add_metric([self.node], h.source_errors)
        yield errors
