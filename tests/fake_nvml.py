# ruff: noqa: N802  (the fake's methods carry NVML's function names)
"""A fake ``pynvml`` (nvidia-ml-py) module for the calls ``opsd_agent.gpu.NvmlSource`` makes.

A fake, because no GPU and so no NVML library exists on the machines the tests run on. It behaves as the real
module does on those calls: an error is an ``NVMLError`` subclass named by its code (``NVMLError_Timeout`` when an
event wait finds nothing, ``NVMLError_NotSupported`` for a counter a GPU lacks, ``NVMLError_FunctionNotFound`` for
a call the driver's library does not have, ``NVMLError_Uninitialized`` before ``nvmlInit`` or after
``nvmlShutdown``, ``NVMLError_LibraryNotFound`` from ``nvmlInit`` without a library); a device handle is a ctypes
pointer, and an event's ``device`` is another pointer object to the same device (compare addresses, as with the
real one); the units are NVML's (degrees C, MHz, milliwatts, retired pages as a list of addresses, remapped rows
as a 4-tuple); events reach only event sets their device was registered with, for the types registered. Its
constants and error codes are the real module's values, and each of its functions is one the real module has
(tests/test_gpu_health.py checks both against the installed nvidia-ml-py).
"""

from __future__ import annotations

import ctypes
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

CONSTANTS = {
    "NVML_TEMPERATURE_GPU": 0,
    "NVML_CLOCK_SM": 1,
    "NVML_NVLINK_MAX_LINKS": 36,
    "NVML_NVLINK_ERROR_DL_REPLAY": 0,
    "NVML_NVLINK_ERROR_DL_RECOVERY": 1,
    "NVML_NVLINK_ERROR_DL_CRC_FLIT": 2,
    "NVML_NVLINK_ERROR_DL_CRC_DATA": 3,
    "NVML_MEMORY_ERROR_TYPE_CORRECTED": 0,
    "NVML_MEMORY_ERROR_TYPE_UNCORRECTED": 1,
    "NVML_VOLATILE_ECC": 0,
    "NVML_AGGREGATE_ECC": 1,
    "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS": 0,
    "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR": 1,
    "nvmlEventTypeXidCriticalError": 0x8,
}
#: error class name -> (NVML_ERROR_* code, its text)
ERRORS = {
    "NVMLError_Uninitialized": (1, "Uninitialized"),
    "NVMLError_NotSupported": (3, "Not Supported"),
    "NVMLError_Timeout": (10, "Timeout"),
    "NVMLError_LibraryNotFound": (12, "NVML Shared Library Not Found"),
    "NVMLError_FunctionNotFound": (13, "Function Not Found"),
}


class NVMLError(Exception):
    value = 999

    def __str__(self) -> str:
        return next((text for code, text in ERRORS.values() if code == self.value), f"NVML Error {self.value}")


ERROR_CLASSES: dict[str, type[NVMLError]] = {
    name: type(name, (NVMLError,), {"value": code}) for name, (code, _) in ERRORS.items()
}


class _Device(ctypes.Structure):
    _fields_ = [("index", ctypes.c_uint)]


class EventData(ctypes.Structure):
    """Shaped as pynvml's ``c_nvmlEventData_t``."""

    _fields_ = [
        ("device", ctypes.POINTER(_Device)),
        ("eventType", ctypes.c_ulonglong),
        ("eventData", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


@dataclass
class FakeGpu:
    uuid: str
    temperature_c: int = 40
    sm_clock_mhz: int = 1980
    power_mw: int = 300_000
    clocks_event_reasons: int = 0
    ecc: dict[tuple[int, int], int] = field(default_factory=dict)  # (error type, counter type) -> count
    retired_pages: dict[int, list[int]] = field(default_factory=dict)  # cause -> page addresses
    remapped_rows: tuple[int, int, int, int] = (0, 0, 0, 0)  # correctable, uncorrectable, pending, failure
    nvlink_errors: dict[tuple[int, int], int] = field(default_factory=dict)  # (link, counter) -> count
    unsupported: set[str] = field(default_factory=set)  # the calls this GPU answers with NOT_SUPPORTED


class FakeNvml:
    """The state behind the module: GPUs, event sets, XID events waiting; what was called."""

    def __init__(self, gpus: list[FakeGpu], *, library: bool = True, missing: frozenset[str] = frozenset()) -> None:
        self.gpus = gpus
        self.library = library
        self.missing = missing  # functions the driver's library lacks (an older driver)
        self.initialised = False
        self.shutdowns = 0
        self._devices = [_Device(i) for i in range(len(gpus))]
        self.event_sets: dict[int, list[tuple[int, int]]] = {}  # set id -> registered (gpu, event types)
        self.freed: list[int] = []
        self.pending: list[tuple[int, int]] = []  # (gpu, xid) not yet delivered

    def xid(self, gpu: int, xid: int) -> None:
        self.pending.append((gpu, xid))

    def module(self) -> types.ModuleType:
        m = types.ModuleType("pynvml")
        m.__dict__.update(CONSTANTS)
        m.__dict__.update(ERROR_CLASSES)
        m.NVMLError = NVMLError  # type: ignore[attr-defined]
        for name in FUNCTIONS:
            setattr(m, name, self._call(name))
        return m

    def _call(self, name: str) -> Callable[..., Any]:
        method = getattr(self, "_" + name)

        def call(*args: Any) -> Any:
            if name in self.missing:
                raise ERROR_CLASSES["NVMLError_FunctionNotFound"]()
            if name != "nvmlInit" and not self.initialised:
                raise ERROR_CLASSES["NVMLError_Uninitialized"]()
            return method(*args)

        call.__name__ = name
        return call

    def _gpu(self, handle: Any, call: str) -> FakeGpu:
        gpu = self.gpus[handle.contents.index]
        if call in gpu.unsupported:
            raise ERROR_CLASSES["NVMLError_NotSupported"]()
        return gpu

    def _nvmlInit(self) -> None:
        if not self.library:
            raise ERROR_CLASSES["NVMLError_LibraryNotFound"]()
        self.initialised = True

    def _nvmlShutdown(self) -> None:
        self.initialised = False
        self.shutdowns += 1

    def _nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def _nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        return ctypes.pointer(self._devices[index])

    def _nvmlEventSetCreate(self) -> Any:
        event_set = len(self.event_sets) + 1
        self.event_sets[event_set] = []
        return event_set

    def _nvmlDeviceRegisterEvents(self, handle: Any, types_: int, event_set: int) -> None:
        self._gpu(handle, "nvmlDeviceRegisterEvents")
        self.event_sets[event_set].append((handle.contents.index, types_))

    def _nvmlEventSetWait_v2(self, event_set: int, timeout_ms: int) -> EventData:
        xid_type = CONSTANTS["nvmlEventTypeXidCriticalError"]
        registered = {gpu for gpu, types_ in self.event_sets[event_set] if types_ & xid_type}
        for n, (gpu, xid) in enumerate(self.pending):
            if gpu in registered:
                del self.pending[n]
                return EventData(ctypes.pointer(self._devices[gpu]), xid_type, xid, 0xFFFFFFFF, 0xFFFFFFFF)
        raise ERROR_CLASSES["NVMLError_Timeout"]()  # (the real call waits up to timeout_ms first)

    def _nvmlEventSetFree(self, event_set: int) -> None:
        self.freed.append(event_set)

    def _nvmlDeviceGetUUID(self, handle: Any) -> str:
        return self._gpu(handle, "nvmlDeviceGetUUID").uuid

    def _nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        assert sensor == CONSTANTS["NVML_TEMPERATURE_GPU"]
        return self._gpu(handle, "nvmlDeviceGetTemperature").temperature_c

    def _nvmlDeviceGetClockInfo(self, handle: Any, clock: int) -> int:
        assert clock == CONSTANTS["NVML_CLOCK_SM"]
        return self._gpu(handle, "nvmlDeviceGetClockInfo").sm_clock_mhz

    def _nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return self._gpu(handle, "nvmlDeviceGetPowerUsage").power_mw

    def _nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        return self._gpu(handle, "nvmlDeviceGetCurrentClocksEventReasons").clocks_event_reasons

    def _nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int:
        return self._gpu(handle, "nvmlDeviceGetCurrentClocksThrottleReasons").clocks_event_reasons

    def _nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter_type: int) -> int:
        return self._gpu(handle, "nvmlDeviceGetTotalEccErrors").ecc.get((error_type, counter_type), 0)

    def _nvmlDeviceGetRetiredPages(self, handle: Any, cause: int) -> list[int]:
        return list(self._gpu(handle, "nvmlDeviceGetRetiredPages").retired_pages.get(cause, []))

    def _nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]:
        return self._gpu(handle, "nvmlDeviceGetRemappedRows").remapped_rows

    def _nvmlDeviceGetNvLinkErrorCounter(self, handle: Any, link: int, counter: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetNvLinkErrorCounter")
        if not any(known == link for known, _ in gpu.nvlink_errors):
            raise ERROR_CLASSES["NVMLError_NotSupported"]()  # a link this GPU does not have
        return gpu.nvlink_errors.get((link, counter), 0)


FUNCTIONS = sorted(name.removeprefix("_") for name in vars(FakeNvml) if name.startswith("_nvml"))
