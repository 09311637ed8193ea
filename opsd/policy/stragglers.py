"""Straggler scoring: which rank computes persistently slower than its peers, and whether a swap pays off.

Pure. A rank's samples are its compute seconds per step (the step minus the time it waited, exposed, in
collectives: a rank that waits for a straggler is not one). Ranks doing the same work are the ranks of the same
pipeline stage; in each slot (a step, or a time bucket) a rank's ratio is its compute time over the median of the
*other* ranks of its stage in that slot (leave-one-out, so that with two ranks a slow one is not hidden by its own
weight in the median). A rank is flagged when, over its last ``window`` slots (at least ``min_samples``), at
least ``persistence_ratio`` of its ratios are >= ``threshold_ratio`` (1.10: 10% slower, the usual definition, e.g.
the OSDI 2025 straggler study). Its slowdown is the median ratio over the window.

The defaults (60% of the last 30 slots, at least 20 of them) are set for noisy slots: where a slot's ratio
scatters by 0.12 around its mean (2 CPU ranks on 2 busy cores), a 1.25x straggler reads below 1.10 in one slot
of 8 and a healthy rank above it in one of 5. Asking 80% of the window then missed 60 s for 1 straggler in 5
(24 slow slots of the first 30 after the onset); 60% of 20 or more flags it in ~40 s and leaves a healthy rank
unflagged through two minutes but for about 1 in 10,000 (a flag is a warning: nothing is stopped for it).

Swap or warn: a straggler slows the whole synchronous job to its pace, so keeping it costs
``remaining_s x (1 - 1 / slowdown)`` of wall time; a swap costs ``swap_cost_s`` (stop, restart, restore, recompute).
Swap when keeping costs more than ``swap_margin`` x the swap.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StragglerConfig:
    threshold_ratio: float = 1.10
    window: int = 30
    min_samples: int = 20
    persistence_ratio: float = 0.6
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
    by_slot: dict[int, dict[tuple[int, int], ComputeSample]] = defaultdict(dict)
    for s in samples:
        by_slot[s.slot][(s.stage, s.rank)] = s
    ratios: dict[int, list[float]] = defaultdict(list)
    where: dict[int, ComputeSample] = {}
    for slot in sorted(by_slot):
        by_stage: dict[int, list[ComputeSample]] = defaultdict(list)
        for s in by_slot[slot].values():
            by_stage[s.stage].append(s)
        for group in by_stage.values():
            for s, ratio in zip(group, peer_ratios([s.compute_s for s in group]), strict=True):
                if ratio is not None:
                    ratios[s.rank].append(ratio)
                    where[s.rank] = s
    scores = [
        score_rank(rank, where[rank].node, where[rank].stage, series[-config.window :], config)
        for rank, series in ratios.items()
    ]
    return sorted(scores, key=lambda x: (not x.flagged, -x.slowdown_ratio, x.rank))


def peer_ratios(compute_s: Sequence[float]) -> list[float | None]:
    """The compute times of the ranks of one stage in one slot -> each one's over the median of the others (None
    for a rank without peers, or whose peers' median is 0). A controller scores 24,576 ranks a slot: plain numbers
    in and out.

    Leaving one of n sorted values out moves the median of the others by at most one place: it is one of three
    values, told apart by how the value left out compares with the middle one (equal values are interchangeable)."""
    n = len(compute_s)
    if n < 2:
        return [None] * n
    values = sorted(compute_s)
    half = (n - 1) // 2  # the median of the n - 1 others: their value at half (odd) or half - 1 and half (even)
    middle = values[half]
    if (n - 1) % 2:  # the others' median is one value: values[half] when it stays, values[half + 1] if not
        above, at, below = middle, values[half + 1], values[half + 1]
    else:
        above = (values[half - 1] + middle) / 2
        at = (values[half - 1] + values[half + 1]) / 2
        below = (middle + values[half + 1]) / 2
    out: list[float | None] = []
    for c in compute_s:
        peers = above if c > middle else at if c == middle else below
        out.append(c / peers if peers > 0 else None)
    return out


def is_straggler(recent_ratios: Sequence[float], config: StragglerConfig) -> bool:
    """Whether a rank's ratios over its last ``window`` slots flag it."""
    n = len(recent_ratios)
    slow = sum(1 for r in recent_ratios if r >= config.threshold_ratio)
    return n >= config.min_samples and slow >= config.persistence_ratio * n


def score_rank(
    rank: int, node: str, stage: int, recent_ratios: Sequence[float], config: StragglerConfig
) -> StragglerScore:
    """A rank's score from its ratios over its last ``window`` slots (oldest first)."""
    flagged = is_straggler(recent_ratios, config)
    return StragglerScore(rank, node, stage, statistics.median(recent_ratios), len(recent_ratios), flagged)


def swap_pays_off(slowdown_ratio: float, remaining_s: float, swap_cost_s: float, config: StragglerConfig) -> bool:
    """Whether swapping the straggler's node saves more time than the swap costs (with the margin)."""
    if slowdown_ratio <= 1 or remaining_s <= 0:
        return False
    keep_cost_s = remaining_s * (1.0 - 1.0 / slowdown_ratio)
    return keep_cost_s > config.swap_margin * swap_cost_s
