"""Straggler scoring: which rank computes persistently slower than its peers, and whether a swap pays off.

Pure. A rank's samples are its compute seconds per step (the step minus the time it waited, exposed, in
collectives: a rank that waits for a straggler is not one). Ranks doing the same work are the ranks of the same
pipeline stage; in each slot (a step, or a time bucket) a rank's ratio is its compute time over the median of the
*other* ranks of its stage in that slot (leave-one-out, so that with two ranks a slow one is not hidden by its own
weight in the median). A rank is flagged when, over its last ``window`` slots (at least ``min_samples``), at
least ``persistence_ratio`` of its ratios are >= ``threshold_ratio`` (1.10: 10% slower, the usual definition, e.g.
the OSDI 2025 straggler study). Its slowdown is the median ratio over the window.

Swap or warn: a straggler slows the whole synchronous job to its pace, so keeping it costs
``remaining_s x (1 - 1 / slowdown)`` of wall time; a swap costs ``swap_cost_s`` (stop, restart, restore, recompute).
Swap when keeping costs more than ``swap_margin`` x the swap.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class StragglerConfig:
    threshold_ratio: float = 1.10
    window: int = 30
    min_samples: int = 10
    persistence_ratio: float = 0.8
    swap_margin: float = 1.5

    def __post_init__(self) -> None:
        if self.threshold_ratio <= 1:
            raise ValueError("stragglers.threshold_ratio must be > 1")
        if not 1 <= self.min_samples <= self.window:
            raise ValueError("stragglers.min_samples must be between 1 and stragglers.window")
        if not 0 < self.persistence_ratio <= 1:
            raise ValueError("stragglers.persistence_ratio must be in (0, 1]")
        if self.swap_margin <= 0:
            raise ValueError("stragglers.swap_margin must be > 0")


@dataclass(frozen=True)
class ComputeSample:
    rank: int
    node: str
    stage: int  # pipeline stage (0 without pipeline parallelism)
    slot: int  # what makes samples comparable: the step, or a time bucket when samples are taken periodically
    compute_s: float


@dataclass(frozen=True)
class StragglerScore:
    rank: int
    node: str
    stage: int
    slowdown_ratio: float  # median of its ratios over the window
    samples: int
    flagged: bool


def score_stragglers(samples: Iterable[ComputeSample], config: StragglerConfig) -> list[StragglerScore]:
    """A score per rank that has peers, flagged ones first, then by slowdown (largest first)."""
    by_slot: dict[tuple[int, int], dict[int, ComputeSample]] = defaultdict(dict)
    for s in samples:
        by_slot[(s.stage, s.slot)][s.rank] = s
    ratios: dict[int, list[tuple[int, float]]] = defaultdict(list)
    where: dict[int, ComputeSample] = {}
    for (_, slot), ranks in by_slot.items():
        if len(ranks) < 2:
            continue
        for rank, s in ranks.items():
            peers = statistics.median(o.compute_s for r, o in ranks.items() if r != rank)
            if peers > 0:
                ratios[rank].append((slot, s.compute_s / peers))
                where[rank] = s
    scores = []
    for rank, series in ratios.items():
        recent = [ratio for _, ratio in sorted(series)[-config.window :]]
        slow = sum(1 for r in recent if r >= config.threshold_ratio)
        flagged = len(recent) >= config.min_samples and slow >= config.persistence_ratio * len(recent)
        s = where[rank]
        scores.append(StragglerScore(rank, s.node, s.stage, statistics.median(recent), len(recent), flagged))
    return sorted(scores, key=lambda x: (not x.flagged, -x.slowdown_ratio, x.rank))


def swap_pays_off(slowdown_ratio: float, remaining_s: float, swap_cost_s: float, config: StragglerConfig) -> bool:
    """Whether swapping the straggler's node saves more time than the swap costs (with the margin)."""
    if slowdown_ratio <= 1 or remaining_s <= 0:
        return False
    keep_cost_s = remaining_s * (1.0 - 1.0 / slowdown_ratio)
    return keep_cost_s > config.swap_margin * swap_cost_s
