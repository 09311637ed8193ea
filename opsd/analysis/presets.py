"""Failure workloads of published training runs, for ``opsd simulate`` (sources and assumptions: docs/simulation.md).

A workload is a job size, an interruption rate at that size, and a mix of causes. A cause is known by its
category, and a category by how it shows and whether the node must go:

- ``signal``: how the failure shows, which sets the detection delay of a detection model: ``xid`` (a GPU error the
  agent reads from NVML), ``node_lost`` (the node stops: its heartbeats stop), ``exit`` (a rank process exits),
  ``hang`` (ranks stop stepping: only a timeout finds it).
- ``swap``: the node is taken out and a spare brought in (hardware), or the job restarts on the same nodes.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from importlib import resources
from types import MappingProxyType

SIGNALS = ("xid", "node_lost", "exit", "hang")


@dataclass(frozen=True)
class Category:
    signal: str
    swap: bool

    def __post_init__(self) -> None:
        if self.signal not in SIGNALS:
            raise ValueError(f"category.signal must be one of {', '.join(SIGNALS)}, not {self.signal!r}")


CATEGORIES = MappingProxyType(
    {
        "GPU": Category("xid", swap=True),
        "host": Category("node_lost", swap=True),
        "unplanned maintenance": Category("node_lost", swap=True),
        "network": Category("hang", swap=True),
        "dependency": Category("exit", swap=False),
        "unknown": Category("hang", swap=False),
    }
)

# Detection delay by signal (seconds). opsd: the agent's XID watch and a heartbeat every second, a process exit seen
# by the launcher, a hang found at max(3 x median step, floor); "watchdog": what a job without opsd sees: every fault
# that stalls a collective waits for the NCCL watchdog (10 minutes), an exit is seen by the scheduler in ~30 s.
DETECTION = MappingProxyType(
    {
        "opsd": MappingProxyType({"xid": 5.0, "node_lost": 10.0, "exit": 2.0, "hang": 60.0}),
        "watchdog": MappingProxyType({"xid": 300.0, "node_lost": 300.0, "exit": 30.0, "hang": 300.0}),
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

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1 or self.gpus % self.gpus_per_node:
            raise ValueError("workload.gpus must be a positive multiple of workload.gpus_per_node")
        if self.failures_per_day < 0 or self.days <= 0:
            raise ValueError("workload.failures_per_day must be >= 0 and workload.days > 0")
        if not self.causes or any(w < 0 for _, w in self.causes) or sum(w for _, w in self.causes) <= 0:
            raise ValueError("workload.causes needs at least one category with a positive weight")
        unknown = sorted({c for c, _ in self.causes} - set(CATEGORIES))
        if unknown:
            raise ValueError(f"workload.causes: unknown categories {unknown}; known: {sorted(CATEGORIES)}")

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node

    def scaled(self, gpus: int) -> Workload:
        """The same per-GPU failure rate and mix at another size."""
        rate = self.failures_per_day * gpus / self.gpus
        return Workload(self.name, gpus, self.gpus_per_node, rate, self.causes, self.days, self.source)


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
            "llama3-405b", 16384, 8, 419 / 54, llama3_causes(), 54, "Llama 3 paper, 3.3.4: 419 in 54 days"
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
