"""Whether the agent reads its node's GPUs, and why not: the configured GPU source, opened again while it cannot be.

An agent that cannot open its source (no NVML in the container: the container runtime injected no driver, or a
device node it may not open) still does the rest of its work: it takes its ranks' reports, serves ``/metrics`` and
heartbeats to the controller. What it cannot see is said in ``opsd_agent_gpu_source_up`` (docs/metrics.md), in
``/healthz`` (which the chart's ``helm test`` reads on every agent) and in its log, once per change. The source is
tried again every ``retry_s``: a driver installed after the agent started (GKE installs it at boot, from a
DaemonSet) is taken up without a restart.

The reasons are few and stable (a label value): ``ok``, ``library_not_found`` (no ``libnvidia-ml.so.1`` in the
container), ``driver_not_loaded``, ``no_permission`` (the device nodes cannot be opened), ``no_gpus`` (NVML answers
but shows no GPU: the runtime hid them), ``error`` (anything else; the log has the text).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from opsd.errors import OpsError
from opsd.protocol.gpu_files import GpuSample
from opsd_agent.gpu import GpuSource, open_source

log = logging.getLogger(__name__)

REASONS = ("ok", "library_not_found", "driver_not_loaded", "no_permission", "no_gpus", "error")
HINT = "the agent goes on without GPU health (docs/kubernetes.md, 'GPU access', says how a pod reaches NVML)"
# NVML's error texts (nvmlErrorString) -> the reason
_NVML_TEXTS = (
    ("shared library not found", "library_not_found"),
    ("function not found", "library_not_found"),
    ("driver not loaded", "driver_not_loaded"),
    ("insufficient permissions", "no_permission"),
    ("no permission", "no_permission"),
)


def reason_of(message: str) -> str:
    """The reason of a source that could not be opened, from its error's text."""
    lowered = message.lower()
    return next((reason for text, reason in _NVML_TEXTS if text in lowered), "error")


def source_kind(spec: str) -> str:
    """``nvml``, ``none`` or ``file`` (the fake, whatever its directory): a label value."""
    return "file" if spec.startswith("file:") else spec


@dataclass(frozen=True)
class GpuStatus:
    source: str  # source_kind of the configured source
    available: bool
    reason: str  # one of REASONS
    detail: str = ""  # the error's text
    gpus: int = 0

    def as_json(self) -> dict[str, object]:
        return {
            "source": self.source,
            "available": self.available,
            "reason": self.reason,
            "detail": self.detail,
            "gpus": self.gpus,
        }


class GpuAccess:
    """A ``GpuSource`` over the configured one: while that cannot be opened, no samples and no events, and another
    try every ``retry_s`` (at the GPU thread's next sample)."""

    def __init__(
        self,
        spec: str,
        *,
        retry_s: float = 60.0,
        opener: Callable[[str], GpuSource] = open_source,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if retry_s <= 0:
            raise ValueError("gpu.retry_s must be > 0")
        self.spec = spec
        self.retry_s = retry_s
        self._opener = opener
        self._clock = clock
        self._source: GpuSource | None = None
        self._tried_s: float | None = None
        self.status = GpuStatus(source_kind(spec), False, "error", "not opened yet")
        self._lock = threading.Lock()
        self._open()

    def _open(self) -> GpuSource | None:
        self._tried_s = self._clock()
        try:
            self._source = self._opener(self.spec)
        except OpsError as exc:
            self._set(GpuStatus(source_kind(self.spec), False, reason_of(str(exc)), str(exc)))
            return None
        self._set(GpuStatus(source_kind(self.spec), True, "ok"))
        return self._source

    def _set(self, status: GpuStatus) -> None:
        with self._lock:
            before, self.status = self.status, status
        if (before.available, before.reason) == (status.available, status.reason):
            return
        if status.available:
            log.info("GPU source %s: reading %d GPU(s)", status.source, status.gpus)
        else:
            log.warning("GPU source %s unavailable (%s: %s): %s", status.source, status.reason, status.detail, HINT)

    def _current(self) -> GpuSource | None:
        if self._source is None and (self._tried_s is None or self._clock() - self._tried_s >= self.retry_s):
            return self._open()
        return self._source

    # -- GpuSource -------------------------------------------------------------------------------------------------
    def sample(self) -> list[GpuSample]:
        source = self._current()
        if source is None:
            return []
        samples = source.sample()
        kind = source_kind(self.spec)
        if kind == "nvml" and not samples:
            self._set(GpuStatus(kind, False, "no_gpus", "NVML answers, but shows no GPU"))
        else:
            self._set(GpuStatus(kind, True, "ok", gpus=len(samples)))
        return samples

    def xid_events(self, timeout_s: float) -> list[tuple[int, int]]:
        source = self._source
        if source is None:
            time.sleep(timeout_s)
            return []
        return source.xid_events(timeout_s)

    def close(self) -> None:
        if self._source is not None:
            self._source.close()


class GpuAccessCollector(Collector):
    def __init__(self, access: GpuAccess, node: str) -> None:
        self.access = access
        self.node = node

    def collect(self) -> Iterator[Metric]:
        status = self.access.status
        up = GaugeMetricFamily(
            "opsd_agent_gpu_source_up",
            "1 when the agent reads the node's GPUs through its source; 0 with the reason it cannot.",
            labels=["node", "source", "reason"],
        )
        up.add_metric([self.node, status.source, status.reason], 1.0 if status.available else 0.0)
        yield up
