"""The pipeline bubble's theory and a run's measured bubble beside it (opsd.policy.pipeline): tables of named cases."""

from __future__ import annotations

import pytest

from opsd.policy.pipeline import PipelineConfig, RankBubble, bubble_ratio, run_bubble, theoretical_bubble_ratio

THEORY = {
    "gpipe, 4 stages, 8 micro-batches": (("gpipe", 4, 8), 3 / 11),
    "1f1b has the same bubble as gpipe": (("1f1b", 4, 8), 3 / 11),
    "one stage has no bubble": (("1f1b", 1, 8), 0.0),
    "more micro-batches, smaller bubble": (("1f1b", 4, 32), 3 / 35),
    "a schedule without a formula here": (("zero_bubble", 4, 8), None),
    "a trainer that named no schedule": (("", 4, 8), None),
    "no micro-batch": (("gpipe", 4, 0), None),
}


@pytest.mark.parametrize(("args", "expected"), THEORY.values(), ids=THEORY.keys())
def test_theory(args: tuple[str, int, int], expected: float | None) -> None:
    assert theoretical_bubble_ratio(*args) == (pytest.approx(expected) if expected is not None else None)


def test_interleaving_divides_the_bubble_slots() -> None:
    assert bubble_ratio(4, 8, chunks=2) == pytest.approx(3 / 19)
    with pytest.raises(ValueError, match="chunks"):
        bubble_ratio(4, 8, chunks=0)


def stage(rank: int, pp: int, ratio: float, m: int = 8, schedule: str = "1f1b") -> RankBubble:
    return RankBubble(rank, pp, ratio, schedule, 2, m)


RUNS = {
    "as the theory": ([stage(0, 0, 0.12), stage(1, 1, 0.10)], 0.11, 1 / 9, False),
    "just within the margin": ([stage(0, 0, 0.20), stage(1, 1, 0.22)], 0.21, 1 / 9, False),
    "over the margin": ([stage(0, 0, 0.30), stage(1, 1, 0.20)], 0.25, 1 / 9, True),
    "ranks disagree on micro-batches: no theory": ([stage(0, 0, 0.5), stage(1, 1, 0.5, m=4)], 0.5, None, False),
    "a ratio out of range is clamped": ([stage(0, 0, 1.5), stage(1, 1, 0.5)], 0.75, 1 / 9, True),
}


@pytest.mark.parametrize(("ranks", "measured", "theory", "over"), RUNS.values(), ids=RUNS.keys())
def test_run_bubble(ranks: list[RankBubble], measured: float, theory: float | None, over: bool) -> None:
    bubble = run_bubble(ranks, PipelineConfig(margin_ratio=0.10))
    assert bubble is not None
    assert bubble.measured_ratio == pytest.approx(measured)
    assert bubble.theoretical_ratio == (pytest.approx(theory) if theory is not None else None)
    assert bubble.over_theory is over


def test_per_stage_figures_and_no_pipeline() -> None:
    bubble = run_bubble([stage(0, 0, 0.3), stage(2, 0, 0.1), stage(1, 1, 0.2)], PipelineConfig())
    assert bubble is not None
    assert bubble.stage_ratios == {0: pytest.approx(0.2), 1: pytest.approx(0.2)}
    assert run_bubble([], PipelineConfig()) is None
    with pytest.raises(ValueError, match=r"pipeline\.margin_ratio"):
        PipelineConfig(margin_ratio=-0.1)
