"""The pipeline bubble: the theory of a schedule, and a run's measured bubble set beside it.

Pure. Theory: with ``p`` stages of equal cost and ``m`` micro-batches, GPipe (Huang et al. 2019) and 1F1B
(PipeDream-Flush; Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", section 2.2.1) leave every stage idle for ``(p - 1)`` slots of forward and backward out of
``(m + p - 1)``: a bubble of ``(p - 1) / (m + p - 1)``. 1F1B holds fewer activations, not a smaller bubble. The
interleaved schedule with ``v`` model chunks per stage divides the bubble's slots by ``v``:
``(p - 1) / (v m + p - 1)`` (same paper, section 2.2.2).

Measured: each rank reports, per step, the time its training thread waited on the pipeline's sends and receives
(``trainer_hooks``); its bubble is that time over its step. Stages see the bubble at different ends (the first
stage waits for gradients at the end of the step, the last for activations at its start) but, for stages of equal
cost, for the same total; the run's figure is the mean over its ranks, and its stages' figures the means over the
ranks of each stage. A run is over its theory when the measured mean exceeds the theory by more than
``margin_ratio`` (absolute, in fraction of the step).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

#: the schedules whose bubble has a formula here (a rank may report another: its bubble is measured, not compared)
SCHEDULES = ("gpipe", "1f1b")


def bubble_ratio(stages: int, micro_batches: int, chunks: int = 1) -> float:
    """Idle fraction of a GPipe or 1F1B schedule, (p - 1) / (m + p - 1); of an interleaved 1F1B schedule with
    ``chunks`` model chunks per stage, (p - 1) / (chunks x m + p - 1)."""
    if stages < 1 or micro_batches < 1:
        raise ValueError("stages and micro_batches must be >= 1")
    if chunks < 1:
        raise ValueError("chunks must be >= 1")
    return (stages - 1) / (chunks * micro_batches + stages - 1)


def theoretical_bubble_ratio(schedule: str, stages: int, micro_batches: int) -> float | None:
    """The bubble of ``schedule`` (one of ``SCHEDULES``) on ``stages`` stages with ``micro_batches`` micro-batches;
    None for a schedule without a formula here, or figures that describe no pipeline (no stage or micro-batch)."""
    if schedule not in SCHEDULES or stages < 1 or micro_batches < 1:
        return None
    return bubble_ratio(stages, micro_batches)


@dataclass(frozen=True)
class PipelineConfig:
    """``margin_ratio``: how far (absolute fraction of the step) the measured bubble may exceed the theory."""

    margin_ratio: float = 0.10

    def __post_init__(self) -> None:
        if not 0 <= self.margin_ratio < 1:
            raise ValueError("pipeline.margin_ratio must be in [0, 1)")


@dataclass(frozen=True)
class RankBubble:
    """What one rank reports of the pipeline: its stage, its last step's bubble ratio, and the schedule it runs."""

    rank: int
    stage: int
    bubble_ratio: float
    schedule: str = ""
    stages: int = 0
    micro_batches: int = 0


@dataclass(frozen=True)
class RunBubble:
    """A run's pipeline bubble: measured (mean over its ranks, and per stage) and the theory of its schedule (None
    when its ranks did not say, or disagree, or its schedule has no formula)."""

    measured_ratio: float
    stage_ratios: dict[int, float]
    ranks: int
    schedule: str
    stages: int
    micro_batches: int
    theoretical_ratio: float | None
    margin_ratio: float

    @property
    def excess_ratio(self) -> float | None:
        """How far the measured bubble is above the theory (negative: below); None without a theory."""
        return None if self.theoretical_ratio is None else self.measured_ratio - self.theoretical_ratio

    @property
    def over_theory(self) -> bool:
        """Whether the measured bubble exceeds the theory by more than the margin."""
        excess = self.excess_ratio
        return excess is not None and excess > self.margin_ratio


def run_bubble(ranks: Iterable[RankBubble], config: PipelineConfig) -> RunBubble | None:
    """The run's bubble from its ranks' last reports; None when no rank reported one. The schedule, stages and
    micro-batches are those every rank reporting them agrees on (none: no theory)."""
    ranks = [r for r in ranks if math.isfinite(r.bubble_ratio)]
    if not ranks:
        return None
    by_stage: dict[int, list[float]] = {}
    for r in ranks:
        by_stage.setdefault(r.stage, []).append(min(max(r.bubble_ratio, 0.0), 1.0))
    stage_ratios = {stage: math.fsum(v) / len(v) for stage, v in sorted(by_stage.items())}
    measured = math.fsum(v for values in by_stage.values() for v in values) / len(ranks)
    described = {(r.schedule, r.stages, r.micro_batches) for r in ranks if r.schedule and r.stages}
    schedule, stages, micro_batches = described.pop() if len(described) == 1 else ("", 0, 0)
    return RunBubble(
        measured_ratio=measured,
        stage_ratios=stage_ratios,
        ranks=len(ranks),
        schedule=schedule,
        stages=stages,
        micro_batches=micro_batches,
        theoretical_ratio=theoretical_bubble_ratio(schedule, stages, micro_batches),
        margin_ratio=config.margin_ratio,
    )
