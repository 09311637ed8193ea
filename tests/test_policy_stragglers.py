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
