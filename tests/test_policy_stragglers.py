"""Straggler scores and the swap decision, as tables of named cases."""

from __future__ import annotations

import pytest

from opsd.policy.stragglers import ComputeSample, StragglerConfig, score_stragglers, swap_pays_off

C = StragglerConfig(threshold_ratio=1.10, window=20, min_samples=10, persistence_ratio=0.8)


def run(
    factors: dict[int, float], steps: int = 20, stages: dict[int, int] | None = None, noise: float = 0.0
) -> list[ComputeSample]:
    """Ranks computing at 1 s x their factor (alternating +-noise per step)."""
    stages = stages or {}
    out = []
    for step in range(steps):
        for rank, factor in factors.items():
            jitter = noise if (step + rank) % 2 else -noise
            stage = stages.get(rank, 0)
            out.append(ComputeSample(rank, f"n{rank // 2}", stage, step, (1.0 + jitter) * factor * (1 + stage)))
    return out


CASES: dict[str, tuple[list[ComputeSample], list[int]]] = {
    "all equal": (run({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}), []),
    "noise is no straggler": (run({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}, noise=0.04), []),
    "one rank 30% slower": (run({0: 1.0, 1: 1.0, 2: 1.3, 3: 1.0}), [2]),
    "two ranks: the slow one still shows": (run({0: 1.0, 1: 1.3}), [1]),
    "9% slower is under the threshold": (run({0: 1.0, 1: 1.0, 2: 1.09, 3: 1.0}), []),
    "too few steps yet": (run({0: 1.0, 1: 1.0, 2: 1.5}, steps=5), []),
    "stages compared only within themselves": (
        run({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}, stages={2: 1, 3: 1}),  # stage 1 is twice as slow: by design
        [],
    ),
    "a slow rank in stage 1": (run({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.25}, stages={2: 1, 3: 1}), [3]),
}


@pytest.mark.parametrize(("samples", "flagged"), CASES.values(), ids=CASES.keys())
def test_score_stragglers(samples: list[ComputeSample], flagged: list[int]) -> None:
    scores = score_stragglers(samples, C)
    assert [s.rank for s in scores if s.flagged] == flagged
    for s in scores:
        if s.flagged:
            assert s.slowdown_ratio >= 1.10
            assert s.node == f"n{s.rank // 2}"


def test_an_episode_that_ended_is_forgotten_after_the_window() -> None:
    slow = [s for s in run({0: 1.0, 1: 1.0, 2: 1.3}, steps=20)]
    recovered = [ComputeSample(s.rank, s.node, s.stage, s.slot + 20, 1.0) for s in run({0: 1.0, 1: 1.0, 2: 1.0})]
    assert [s.rank for s in score_stragglers(slow, C) if s.flagged] == [2]
    assert [s.rank for s in score_stragglers(slow + recovered, C) if s.flagged] == []


def test_slowdown_is_the_median_ratio() -> None:
    (top, *_) = score_stragglers(run({0: 1.0, 1: 1.0, 2: 1.3, 3: 1.0}), C)
    assert top.rank == 2
    assert top.slowdown_ratio == pytest.approx(1.3)
    assert top.samples == 20


def first_flagged_slot(ratios: list[float], config: StragglerConfig) -> int | None:
    """The first slot after which rank 1, computing ``ratio`` x rank 0's in each slot, is flagged (None: never)."""
    samples: list[ComputeSample] = []
    for slot, ratio in enumerate(ratios):
        samples += [ComputeSample(0, "n0", 0, slot, 1.0), ComputeSample(1, "n0", 0, slot, ratio)]
        if any(s.flagged for s in score_stragglers(samples, config)):
            return slot
    return None


def noisy(mean: float, slots: int, every: int, off: float) -> list[float]:
    """``slots`` ratios of ``mean`` but every ``every``-th, which is ``mean + off`` (a noisy slot)."""
    return [mean + off if i % every == every - 1 else mean for i in range(slots)]


ONSETS = {
    # name: (the ratios of rank 1, slot by slot; the slot it is flagged by at the latest, None: never)
    # 60 clean slots (2 minutes of 2 s slots) then 30 slow ones (60 s): flagged within them, though 1 slot in 4
    # reads under the threshold (the default 80% of the window would wait for 24 slow slots of 30, past the end)
    "a noisy 1.25x straggler: within 60 s": (noisy(1.0, 60, 5, 0.15) + noisy(1.25, 30, 4, -0.2), 89),
    "a healthy rank 1 slot in 3 over the threshold: never": (noisy(1.0, 120, 3, 0.15), None),
    "an episode of 10 slow slots (20 s): never": (noisy(1.0, 40, 5, 0.15) + [1.3] * 10 + [1.0] * 40, None),
    "a steady 1.3x straggler from the start: at its 20th slot": ([1.3] * 40, 19),
}


@pytest.mark.parametrize(("ratios", "by_slot"), ONSETS.values(), ids=ONSETS.keys())
def test_the_defaults_flag_a_noisy_straggler_within_a_minute_and_a_noisy_healthy_rank_never(
    ratios: list[float], by_slot: int | None
) -> None:
    flagged = first_flagged_slot(ratios, StragglerConfig())
    if by_slot is None:
        assert flagged is None
    else:
        assert flagged is not None
        assert flagged <= by_slot


DECISIONS = {
    # name: (slowdown, remaining_s, swap_cost_s, swap?)
    "long run left: swap": (1.3, 24 * 3600, 600, True),
    "almost done: warn": (1.3, 1800, 600, False),
    "small slowdown: warn": (1.02, 3600, 600, False),
    "margin: keep cost must beat 1.5 x swap": (1.5, 3 * 600 * 1.5 - 1, 600, False),
    "not slower: never": (1.0, 10**6, 1, False),
}


@pytest.mark.parametrize(("slowdown", "remaining_s", "cost_s", "swap"), DECISIONS.values(), ids=DECISIONS.keys())
def test_swap_or_warn(slowdown: float, remaining_s: float, cost_s: float, swap: bool) -> None:
    assert swap_pays_off(slowdown, remaining_s, cost_s, C) is swap


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"threshold_ratio": 1.0}, "threshold"),
        ({"min_samples": 50}, "min_samples"),
        ({"persistence_ratio": 0}, "persistence"),
    ],
    ids=["threshold", "samples", "persistence"],
)
def test_config_validates_itself(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StragglerConfig(**kwargs)  # type: ignore[arg-type]
