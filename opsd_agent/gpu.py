"""GPU health of the node: NVML through nvidia-ml-py, or a file-backed fake with the same interface.

A ``GpuSource`` gives a ``GpuSample`` per GPU (temperature, SM clock, power, clock-event reasons, ECC volatile
and aggregate counts, retired pages, row remapping, NVLink errors) and the XID events since the last call. A field
the GPU cannot give (NVML answers ``NotSupported``: retired pages on a GPU that remaps rows, NVLink counters where
NVLink is not exposed) is None in the sample, and is not exported: a 0 would read as "no errors".

``NvmlSource`` is the thin adapter over the NVML calls listed in its methods. ``FileGpuSource`` is the fake used by
the tests and by the local mode, where no GPU exists: samples come from ``gpus.json`` in its directory and XID
events from the lines appended to ``xids.jsonl`` (``inject_xid`` writes one), so a fault can be injected into a
running agent by writing a file.
"""

from __future__ import annotations

import ctypes
import functools
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
    """NVML through nvidia-ml-py; a missing NVML is a PermanentError. A field whose NVML call fails (``NotSupported``
    or any other NVML error) is None in the sample; each failure is counted per (GPU, field) in ``field_errors``,
    and logged once per NVML call."""

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
        self.field_errors: dict[tuple[int, str], int] = {}  # (gpu, GpuSample field) -> failed reads
        self._logged: set[str] = set()
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

    def _read(self, gpu: int, field: str, call: str, *args: Any) -> Any:
        """``call(*args)``, or None when NVML fails it (counted for ``field`` of ``gpu``, logged once per call)."""
        try:
            return getattr(self._nvml, call)(*args)
        except self._nvml.NVMLError as exc:
            self._failed(gpu, field, call, exc)
            return None

    def _failed(self, gpu: int, field: str, call: str, exc: BaseException) -> None:
        self.field_errors[(gpu, field)] = self.field_errors.get((gpu, field), 0) + 1
        if call not in self._logged:
            self._logged.add(call)
            log.warning("%s failed on gpu %d (%s): %s is not exported (counted, logged once)", call, gpu, exc, field)

    def _nvlink_errors(self, gpu: int, handle: Any) -> int | None:
        """CRC, replay and recovery errors summed over the links that answer; None when none does."""
        n = self._nvml
        total, answered, error = 0, False, None
        for link in range(n.NVML_NVLINK_MAX_LINKS):
            for counter in (
                n.NVML_NVLINK_ERROR_DL_REPLAY,
                n.NVML_NVLINK_ERROR_DL_RECOVERY,
                n.NVML_NVLINK_ERROR_DL_CRC_FLIT,
                n.NVML_NVLINK_ERROR_DL_CRC_DATA,
            ):
                try:
                    total += int(n.nvmlDeviceGetNvLinkErrorCounter(handle, link, counter))
                    answered = True
                except n.NVMLError as exc:  # a link the GPU does not have, or no NVLink at all
                    error = exc
        if not answered and error is not None:
            self._failed(gpu, "nvlink_errors", "nvmlDeviceGetNvLinkErrorCounter", error)
            return None
        return total

    def sample(self) -> list[GpuSample]:
        n = self._nvml
        out = []
        for index, h in enumerate(self._handles):
            get = functools.partial(self._read, index)
            remap = get("remapped_rows", "nvmlDeviceGetRemappedRows", h) or (None, None, None, None)
            reasons = self._get("nvmlDeviceGetCurrentClocksEventReasons", h, default=None)
            if reasons is None:  # an older driver's name for it
                reasons = get("clock_event_reasons", "nvmlDeviceGetCurrentClocksThrottleReasons", h)
            corrected, uncorrected = n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
            sbe = n.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
            dbe = n.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
            ecc = "nvmlDeviceGetTotalEccErrors"
            uuid = self._get("nvmlDeviceGetUUID", h, default="")
            out.append(
                GpuSample(
                    index=index,
                    uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                    temperature_c=_scaled(get("temperature_c", "nvmlDeviceGetTemperature", h, n.NVML_TEMPERATURE_GPU)),
                    sm_clock_hz=_scaled(get("sm_clock_hz", "nvmlDeviceGetClockInfo", h, n.NVML_CLOCK_SM), 1e6),
                    power_w=_scaled(get("power_w", "nvmlDeviceGetPowerUsage", h), 1e-3),
                    clock_event_reasons=_int(reasons),
                    ecc_volatile_corrected=_int(get("ecc_volatile_corrected", ecc, h, corrected, 0)),
                    ecc_volatile_uncorrected=_int(get("ecc_volatile_uncorrected", ecc, h, uncorrected, 0)),
                    ecc_aggregate_corrected=_int(get("ecc_aggregate_corrected", ecc, h, corrected, 1)),
                    ecc_aggregate_uncorrected=_int(get("ecc_aggregate_uncorrected", ecc, h, uncorrected, 1)),
                    retired_pages_sbe=_len(get("retired_pages_sbe", "nvmlDeviceGetRetiredPages", h, sbe)),
                    retired_pages_dbe=_len(get("retired_pages_dbe", "nvmlDeviceGetRetiredPages", h, dbe)),
                    remapped_rows_correctable=_int(remap[0]),
                    remapped_rows_uncorrectable=_int(remap[1]),
                    row_remap_pending=None if remap[2] is None else bool(remap[2]),
                    nvlink_errors=self._nvlink_errors(index, h),
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


def _scaled(value: Any, scale: float = 1.0) -> float | None:
    return None if value is None else float(value) * scale


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _len(value: Any) -> int | None:
    return None if value is None else len(value)


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
