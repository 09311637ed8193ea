"""Failure workloads of published training runs, for ``opsd simulate`` (sources and assumptions: docs/simulation.md).

A workload is a job size, an interruption rate at that size, and a mix of causes. A cause is known by its
category, and a category by how it shows and whether the node must go:

- ``signal``: how the failure shows, which sets the detection delay of a detection model: ``xid`` (a GPU error the
  agent reads from NVML), ``node_lost`` (the node stops: its heartbeats stop), ``exit`` (a rank process exits),
  ``hang`` (ranks stop stepping: only a timeout finds it), ``silent`` (nothing shows: a silent data corruption
  is found late, from its symptoms in training, by opsd or not).
- ``swap``: the node is taken out and a spare brought in (hardware), or the job restarts on the same nodes.
- ``spans_groups``: the failure takes nodes of more than one replica group of a fault-tolerant job (a network switch
  serves nodes that groups laid out by rank do not keep together); others stay within one node, so one group.

A workload also has planned interruptions (maintenance, configuration or data updates): the job saves, stops and
restarts; nothing fails, nothing is detected, no work is lost.
"""

from __future__ import annotations

import csv
import dataclasses
import io
from dataclasses import dataclass
from importlib import resources
from types import MappingProxyType

SIGNALS = ("xid", "node_lost", "exit", "hang", "silent")


@dataclass(frozen=True)
class Category:
    signal: str
    swap: bool
    spans_groups: bool = False

    def __post_init__(self) -> None:
        if self.signal not in SIGNALS:
            raise ValueError(f"category.signal must be one of {', '.join(SIGNALS)}, not {self.signal!r}")


CATEGORIES = MappingProxyType(
    {
        "GPU": Category("xid", swap=True),
        "host": Category("node_lost", swap=True),
        "unplanned maintenance": Category("node_lost", swap=True),
        "network": Category("hang", swap=True, spans_groups=True),
        "dependency": Category("exit", swap=False),
        "unknown": Category("hang", swap=False),
        "silent data corruption": Category("silent", swap=True),
    }
)

#: Seconds from a silent data corruption to its discovery, under any detection model. An assumption: the hardware
#: reports nothing (no XID, no exit, no hang), so the corruption is found only from its symptoms in training (a NaN, a
#: loss or gradient-norm spike, a divergence), then confirmed by replaying from a checkpoint; no published run gives
#: the delay (Llama 3 counts 6 such interruptions, Table 5; Gemini's report speaks of one every week or two, found
#: with dedicated replay). An hour is a few hundred steps of a large job. opsd has no detector of its own for it.
SILENT_DETECTION_S = 3600.0


@dataclass(frozen=True)
class Detection:
    """Seconds from a failure to its detection, by how the failure shows (``SIGNALS``)."""

    xid_s: float
    node_lost_s: float
    exit_s: float
    hang_s: float
    silent_s: float = SILENT_DETECTION_S

    def __post_init__(self) -> None:
        if min(self.xid_s, self.node_lost_s, self.exit_s, self.hang_s, self.silent_s) < 0:
            raise ValueError("detection delays must be >= 0")

    def delay_s(self, signal: str) -> float:
        if signal not in SIGNALS:
            raise ValueError(f"signal must be one of {', '.join(SIGNALS)}, not {signal!r}")
        return float(getattr(self, f"{signal}_s"))

    def plus(self, extra_s: float) -> Detection:
        """Every delay a detector sets made ``extra_s`` longer (a silent corruption's is left as it is)."""
        return dataclasses.replace(
            self,
            xid_s=self.xid_s + extra_s,
            node_lost_s=self.node_lost_s + extra_s,
            exit_s=self.exit_s + extra_s,
            hang_s=self.hang_s + extra_s,
        )


# Detection delays. opsd: the agent's XID watch and a heartbeat every second, a process exit seen by the launcher, a
# node lost after max(5 missed heartbeats, 10 s), a hang found at max(3 x median step, 60 s) (the defaults of
# opsd.policy.detection.DetectionConfig). "watchdog": what a job without opsd sees: every fault that stalls a
# collective waits for the collective timeout, 300 s (5 minutes) in this reconstruction (torch's default for NCCL
# is 10 minutes); an exit is seen by the scheduler in ~30 s.
DETECTION = MappingProxyType(
    {
        "opsd": Detection(xid_s=5.0, node_lost_s=10.0, exit_s=2.0, hang_s=60.0),
        "watchdog": Detection(xid_s=300.0, node_lost_s=300.0, exit_s=30.0, hang_s=300.0),
    }
)


@dataclass(frozen=True)
class Workload:
    name: str
    gpus: int
    gpus_per_node: int
    failures_per_day: float  # unexpected interruptions of the whole job, per day, at ``gpus``
    causes: tuple[tuple[str, float], ...]  # (category, weight)
    days: float  # the length of the run it describes
    source: str
    planned_per_day: float = 0.0  # planned interruptions of the whole job per day (save, stop, restart)

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1 or self.gpus % self.gpus_per_node:
            raise ValueError("workload.gpus must be a positive multiple of workload.gpus_per_node")
        if self.failures_per_day < 0 or self.planned_per_day < 0 or self.days <= 0:
            raise ValueError("workload.failures_per_day and planned_per_day must be >= 0, workload.days > 0")
        if not self.causes or any(w < 0 for _, w in self.causes) or sum(w for _, w in self.causes) <= 0:
            raise ValueError("workload.causes needs at least one category with a positive weight")
        unknown = sorted({c for c, _ in self.causes} - set(CATEGORIES))
        if unknown:
            raise ValueError(f"workload.causes: unknown categories {unknown}; known: {sorted(CATEGORIES)}")

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node

    def scaled(self, gpus: int) -> Workload:
        """The same per-GPU failure rate and mix at another size (planned interruptions are the job's: kept)."""
        return dataclasses.replace(self, gpus=gpus, failures_per_day=self.failures_per_day * gpus / self.gpus)


def llama3_causes() -> tuple[tuple[str, float], ...]:
    """Table 5 of the Llama 3 paper, by category (``opsd/data/llama3_405b_interruptions.csv``)."""
    text = resources.files("opsd").joinpath("data/llama3_405b_interruptions.csv").read_text()
    counts: dict[str, float] = {}
    for row in csv.DictReader(io.StringIO("\n".join(line for line in text.splitlines() if not line.startswith("#")))):
        counts[row["category"]] = counts.get(row["category"], 0.0) + float(row["count"])
    return tuple(sorted(counts.items()))


def presets() -> dict[str, Workload]:
    return {
        "llama3-405b": Workload(
            "llama3-405b",
            16384,
            8,
            419 / 54,
            llama3_causes(),
            54,
            "Llama 3 paper, 3.3.4: 466 interruptions in 54 days, 419 unexpected and 47 planned",
            planned_per_day=47 / 54,
        ),
        "bloom-176b": Workload(
            "bloom-176b", 384, 8, 1.5 / 7, (("GPU", 1.0),), 105, "BLOOM: 1-2 GPU failures a week on 48 nodes"
        ),
        "opt-175b": Workload(
            "opt-175b",
            992,
            8,
            2.0,
            (("GPU", 0.6), ("host", 0.2), ("dependency", 0.1), ("unknown", 0.1)),
            60,
            "OPT-175B logbook: ~2 machines down a day",
        ),
    }


def custom_workload(gpus: int, gpus_per_node: int, failures_per_day: float, mix: str, days: float) -> Workload:
    """A workload from the command line; ``mix`` is ``category=weight,...`` (e.g. ``GPU=0.7,dependency=0.3``)."""
    causes = []
    for part in (p.strip() for p in mix.split(",") if p.strip()):
        name, sep, weight = part.partition("=")
        try:
            causes.append((name.strip(), float(weight)))
        except ValueError:
            raise ValueError(f"cause mix: {part!r} is not category=weight") from None
        if not sep:
            raise ValueError(f"cause mix: {part!r} is not category=weight")
    return Workload("custom", gpus, gpus_per_node, failures_per_day, tuple(causes), days, "custom")
