"""The file-backed fake GPU source of a node without GPUs (the tests, ``opsd run``'s local nodes): a directory that
describes the node's GPUs and their XID events, written by whoever plays the hardware and read by the node agent
(``opsd_agent.gpu.FileGpuSource``).

- ``gpus.json``: a list of ``GpuSample`` objects, replaced atomically (``write_samples``);
- ``xids.jsonl``: one ``{"gpu": 0, "xid": 79}`` line per XID event, appended (``inject_xid``); the agent reports the
  lines written after it opened the source.

``GpuSample`` is also what the agent reads from NVML on a real node.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

SAMPLES_FILE = "gpus.json"
XIDS_FILE = "xids.jsonl"


@dataclass(frozen=True)
class GpuSample:
    """One GPU's health. A field the GPU does not support (NVML's ``NotSupported``; ``null`` in ``gpus.json``) is
    None: it is not exported, rather than read as 0."""

    index: int
    uuid: str
    temperature_c: float | None = 0.0
    sm_clock_hz: float | None = 0.0
    power_w: float | None = 0.0
    clock_event_reasons: int | None = 0  # NVML's bitmask of why clocks are held down (thermal, power, ...)
    ecc_volatile_corrected: int | None = 0
    ecc_volatile_uncorrected: int | None = 0
    ecc_aggregate_corrected: int | None = 0
    ecc_aggregate_uncorrected: int | None = 0
    retired_pages_sbe: int | None = 0
    retired_pages_dbe: int | None = 0
    remapped_rows_correctable: int | None = 0
    remapped_rows_uncorrectable: int | None = 0
    row_remap_pending: bool | None = False
    nvlink_errors: int | None = 0  # CRC, replay and recovery errors summed over the links


def write_samples(directory: str | Path, samples: list[GpuSample]) -> None:
    """Replace the fake's ``gpus.json`` atomically."""
    path = Path(directory) / SAMPLES_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([asdict(s) for s in samples]))
    os.replace(tmp, path)


def inject_xid(directory: str | Path, gpu: int, xid: int) -> None:
    """Append an XID event for the fake source (what the local mode's fault injection does)."""
    with (Path(directory) / XIDS_FILE).open("a") as f:
        f.write(json.dumps({"gpu": gpu, "xid": xid}) + "\n")
