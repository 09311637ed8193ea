"""GPU health of the node: NVML through nvidia-ml-py, or a file-backed fake with the same interface.

A ``GpuSource`` gives a ``GpuSample`` per GPU (temperature, SM clock, power, clock-event reasons, ECC volatile
and aggregate counts, retired pages, row remapping, NVLink errors) and the XID events since the last call.

``NvmlSource`` is the thin adapter over the NVML calls listed in its methods. ``FileGpuSource`` is the fake used by
the tests and by the local mode, where no GPU exists: samples come from ``gpus.json`` in its directory and XID
events from the lines appended to ``xids.jsonl`` (``inject_xid`` writes one), so a fault can be injected into a
running agent by writing a file.
"""

from __future__ import annotations

import ctypes
import json
import logging
import time
from dataclasses import fields
from pathlib import Path
from typing import Any, Protocol

from opsd.errors import PermanentError
from opsd.protocol.gpu_files import SAMPLES_FILE, XIDS_FILE, GpuSample

log = logging.getLogger(__name__)


class GpuSource(Protocol):
    def sample(self) -> list[GpuSample]: ...

    def xid_events(self, timeout_s: float) -> list[tuple[int, int]]:
        """(gpu index, xid) of the XID events since the last call, waiting up to ``timeout_s`` for one."""
        ...

    def close(self) -> None: ...


class NoGpuSource:
    """A node without GPUs."""

    def sample(self) -> list[GpuSample]:
        return []

    def xid_events(self, timeout_s: float) -> list[tuple[int, int]]:
        time.sleep(timeout_s)
        return []

    def close(self) -> None:
        pass


class FileGpuSource:
    """The fake: ``gpus.json`` (a list of ``GpuSample`` fields) and ``xids.jsonl`` (``{"gpu": 0, "xid": 79}``)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._xids = self.directory / XIDS_FILE
        self._offset = self._xids.stat().st_size if self._xids.exists() else 0  # only events from now on
        self.bad_lines = 0

    def sample(self) -> list[GpuSample]:
        path = self.directory / SAMPLES_FILE
        if not path.exists():
            return []
        known = {f.name for f in fields(GpuSample)}
        try:
            rows = json.loads(path.read_text())
            return [GpuSample(**{k: v for k, v in row.items() if k in known}) for row in rows]
        except (OSError, ValueError, TypeError) as exc:
            raise PermanentError(f"{path}: not a list of GPU samples: {exc}") from None

    def xid_events(self, timeout_s: float) -> list[tuple[int, int]]:
        deadline = time.monotonic() + timeout_s
        while True:
            events = self._read_new()
            if events or time.monotonic() >= deadline:
                return events
            time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))

    def _read_new(self) -> list[tuple[int, int]]:
        if not self._xids.exists():
            return []
        with self._xids.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next call
        self._offset += len(complete)
        events: list[tuple[int, int]] = []
        for line in complete.splitlines():
            try:
                row = json.loads(line)
                events.append((int(row["gpu"]), int(row["xid"])))
            except (ValueError, TypeError, KeyError):
                self.bad_lines += 1
                log.warning("ignored a malformed line of %s: %r", self._xids, line[:200])
        return events

    def close(self) -> None:
        pass


class NvmlSource:
    """NVML through nvidia-ml-py. Counters a GPU does not support read as 0; a missing NVML is a PermanentError."""

    def __init__(self) -> None:
        import pynvml  # type: ignore[import-untyped]

        self._nvml: Any = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise PermanentError(f"NVML is not available: {exc}") from None
        count = pynvml.nvmlDeviceGetCount()
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self._events = pynvml.nvmlEventSetCreate()
        for handle in self._handles:
            try:
                pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, self._events)
            except pynvml.NVMLError as exc:
                log.warning("XID events unavailable on a GPU: %s", exc)

    def _get(self, call: str, *args: Any, default: Any = 0) -> Any:
        try:
            return getattr(self._nvml, call)(*args)
        except self._nvml.NVMLError:
            return default

    def sample(self) -> list[GpuSample]:
        n = self._nvml
        out = []
        for index, h in enumerate(self._handles):
            remap = self._get("nvmlDeviceGetRemappedRows", h, default=(0, 0, 0, 0))
            reasons = self._get("nvmlDeviceGetCurrentClocksEventReasons", h, default=None)
            if reasons is None:
                reasons = self._get("nvmlDeviceGetCurrentClocksThrottleReasons", h)
            nvlink = 0
            for link in range(n.NVML_NVLINK_MAX_LINKS):
                for counter in (
                    n.NVML_NVLINK_ERROR_DL_REPLAY,
                    n.NVML_NVLINK_ERROR_DL_RECOVERY,
                    n.NVML_NVLINK_ERROR_DL_CRC_FLIT,
                    n.NVML_NVLINK_ERROR_DL_CRC_DATA,
                ):
                    nvlink += int(self._get("nvmlDeviceGetNvLinkErrorCounter", h, link, counter))
            corrected, uncorrected = n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
            sbe = n.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
            dbe = n.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
            uuid = self._get("nvmlDeviceGetUUID", h, default="")
            out.append(
                GpuSample(
                    index=index,
                    uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                    temperature_c=float(self._get("nvmlDeviceGetTemperature", h, n.NVML_TEMPERATURE_GPU)),
                    sm_clock_hz=float(self._get("nvmlDeviceGetClockInfo", h, n.NVML_CLOCK_SM)) * 1e6,
                    power_w=float(self._get("nvmlDeviceGetPowerUsage", h)) / 1000,
                    clock_event_reasons=int(reasons),
                    ecc_volatile_corrected=int(self._get("nvmlDeviceGetTotalEccErrors", h, corrected, 0)),
                    ecc_volatile_uncorrected=int(self._get("nvmlDeviceGetTotalEccErrors", h, uncorrected, 0)),
                    ecc_aggregate_corrected=int(self._get("nvmlDeviceGetTotalEccErrors", h, corrected, 1)),
                    ecc_aggregate_uncorrected=int(self._get("nvmlDeviceGetTotalEccErrors", h, uncorrected, 1)),
                    retired_pages_sbe=len(self._get("nvmlDeviceGetRetiredPages", h, sbe, default=[])),
                    retired_pages_dbe=len(self._get("nvmlDeviceGetRetiredPages", h, dbe, default=[])),
                    remapped_rows_correctable=int(remap[0]),
                    remapped_rows_uncorrectable=int(remap[1]),
                    row_remap_pending=bool(remap[2]),
                    nvlink_errors=nvlink,
                )
            )
        return out

    def xid_events(self, timeout_s: float) -> list[tuple[int, int]]:
        n = self._nvml
        events: list[tuple[int, int]] = []
        wait_ms = int(timeout_s * 1000)
        while True:
            try:
                data = n.nvmlEventSetWait_v2(self._events, wait_ms)
            except n.NVMLError_Timeout:
                return events
            index = next((i for i, h in enumerate(self._handles) if _address(h) == _address(data.device)), -1)
            events.append((index, int(data.eventData)))
            wait_ms = 0  # drain what is already there, then return

    def close(self) -> None:
        self._get("nvmlEventSetFree", self._events)
        self._get("nvmlShutdown")


def _address(handle: Any) -> int | None:
    return ctypes.cast(handle, ctypes.c_void_p).value


def open_source(spec: str) -> GpuSource:
    """``nvml``, ``none``, or ``file:DIRECTORY`` (the fake); raises PermanentError for anything else."""
    if spec == "nvml":
        return NvmlSource()
    if spec == "none":
        return NoGpuSource()
    if spec.startswith("file:") and len(spec) > len("file:"):
        return FileGpuSource(spec.removeprefix("file:"))
    raise PermanentError(f"gpu source {spec!r}: expected nvml, none or file:DIRECTORY")
