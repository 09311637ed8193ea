"""Straggler episodes in the goodput simulation (``opsd.analysis.simulation``): a slow rank slows the whole job
(training is synchronous) until the episode ends, or until opsd flags the rank and swaps it."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Stragglers:
    episodes_per_day: float = 0.0  # of the whole job
    duration_h: float = 2.0  # mean length of an episode left alone (exponential)
    slowdown_ratio: float = 1.3  # the job's step time over its normal step time during an episode
    detect_s: float = 60.0  # opsd flags the rank after this long (docs/controller.md: 10 two-second slots, and more)

    def __post_init__(self) -> None:
        if self.episodes_per_day < 0 or self.duration_h <= 0 or self.detect_s < 0:
            raise ValueError("stragglers: episodes_per_day and detect_s must be >= 0, duration_h > 0")
        if self.slowdown_ratio < 1:
            raise ValueError("stragglers.slowdown_ratio must be >= 1")


def straggler_badput(st: Stragglers, days: float, *, swap: bool, swap_cost_s: float, seed: int) -> float:
    """Throughput lost to straggler episodes over ``days`` (drawn apart from the failures, so that both see the same
    failures): the slowdown while an episode lasts, or until opsd flags the rank, plus the swap (``swap``:
    ``swap_cost_s``, a checkpoint and a relaunch with a spare in the straggler's place)."""
    if st.episodes_per_day == 0:
        return 0.0
    rng = random.Random(seed ^ 0x5EED)
    horizon = days * 86400.0
    lost = 0.0
    t = rng.expovariate(st.episodes_per_day / 86400.0)
    while t < horizon:
        length = rng.expovariate(1.0 / (st.duration_h * 3600.0))
        swapped = swap and length > st.detect_s
        exposure = min(length, st.detect_s) if swapped else length
        lost += exposure * (1.0 - 1.0 / st.slowdown_ratio)
        if swapped:
            lost += swap_cost_s
        t += rng.expovariate(st.episodes_per_day / 86400.0)
    return lost
