"""Goodput accounting: where the wall-clock time of a run went, and its effective training time ratio (ETTR).

Pure. Badput buckets: ``startup`` (launch and initialisation: from the run's start to its first productive step,
or to its first failure when that came first), then per interruption: ``detection`` (failure to detection),
``spare_wait`` (waiting for a spare), ``restart`` (detection to the first productive step after the resume, restore
included, spare wait excluded), ``recompute`` (the steps done again after the resume: those since the checkpoint
resumed from). Over the run: ``checkpoint`` (the time saves stopped training). ``productive`` is the rest.

A replica recovery (one replica group of a fault-tolerant run stopped and relaunched, the other groups training
on: ``opsd.policy.replicas``) stops only its group's share of the job (``Interruption.share``): its detection,
spare wait and restart (to its first step in the quorum, after it healed) count at that share, and the other
groups' steps meanwhile are productive. What the other groups lost is the time they waited for a quorum around the
failure (``Interruption.stall_s``, the ``quorum`` bucket, at the whole job's share).
ETTR = productive / wall time (as MegaScale and ByteRobust report it). Only time spent on training steps is
productive, as in Llama 3's effective training time ("The Llama 3 Herd of Models", 2024, section 3.3.4) and in
Kokolis et al.'s ETTR ("Revisiting Reliability in Large-Scale Machine Learning Research Clusters", 2024): the first
start-up is badput, as every relaunch is.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum


class BadputBucket(StrEnum):
    """Where the wall time of a run went: ``productive``, or one of the badput buckets."""

    PRODUCTIVE = "productive"
    STARTUP = "startup"  # launch and initialisation: the run's start to its first productive step
    CHECKPOINT = "checkpoint"  # saves stopped training
    DETECTION = "detection"  # failure to detection
    SPARE_WAIT = "spare_wait"  # waiting for a spare
    RESTART = "restart"  # detection to the first productive step, restore included, spare wait excluded
    RECOMPUTE = "recompute"  # steps done again after the resume
    STRAGGLER = "straggler"  # (the simulator's) a straggler left to slow the job down
    MAINTENANCE = "maintenance"  # (the simulator's) planned stops: the save before, the restart after
    QUORUM = "quorum"  # replica groups waited for a quorum around another group's failure


#: the badput buckets of a run, in the order reports show them
BADPUT = (
    BadputBucket.STARTUP,
    BadputBucket.CHECKPOINT,
    BadputBucket.DETECTION,
    BadputBucket.SPARE_WAIT,
    BadputBucket.RESTART,
    BadputBucket.RECOMPUTE,
    BadputBucket.QUORUM,
)


@dataclass(frozen=True)
class Interruption:
    failed_s: float  # when it failed (injection time, or the last sign of life)
    detected_s: float
    resumed_s: float  # the first productive step after the resume
    lost_steps: int  # steps done again
    step_time_s: float
    spare_wait_s: float = 0.0
    share: float = 1.0  # the fraction of the job it stopped: a replica group's (0-1), or the whole job
    stall_s: float = 0.0  # the rest of the job's wait for a quorum around it (a replica recovery's)
    discarded_steps: int = 0  # the rest of the job's steps discarded around it (a replica recovery's), done again

    def __post_init__(self) -> None:
        if not self.failed_s <= self.detected_s <= self.resumed_s:
            raise ValueError("an interruption needs failed_s <= detected_s <= resumed_s")
        if min(self.lost_steps, self.step_time_s, self.spare_wait_s, self.stall_s, self.discarded_steps) < 0:
            raise ValueError("lost_steps, step_time_s, spare_wait_s, stall_s and discarded_steps must be >= 0")
        if not 0 < self.share <= 1:
            raise ValueError("an interruption's share of the job must be in (0, 1]")


@dataclass(frozen=True)
class Startup:
    """A run's launch and initialisation: from ``started_s`` (the run's start) to ``first_productive_s`` (its first
    productive step; None: none yet)."""

    started_s: float
    first_productive_s: float | None

    def __post_init__(self) -> None:
        if self.first_productive_s is not None and self.first_productive_s < self.started_s:
            raise ValueError("a start-up needs started_s <= first_productive_s")


@dataclass(frozen=True)
class Goodput:
    wall_s: float
    productive_s: float
    checkpoint_s: float
    detection_s: float
    spare_wait_s: float
    restart_s: float
    recompute_s: float
    startup_s: float = 0.0
    quorum_s: float = 0.0

    @property
    def ettr(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def buckets(self) -> dict[BadputBucket, float]:
        return {
            BadputBucket.PRODUCTIVE: self.productive_s,
            BadputBucket.STARTUP: self.startup_s,
            BadputBucket.CHECKPOINT: self.checkpoint_s,
            BadputBucket.DETECTION: self.detection_s,
            BadputBucket.SPARE_WAIT: self.spare_wait_s,
            BadputBucket.RESTART: self.restart_s,
            BadputBucket.RECOMPUTE: self.recompute_s,
            BadputBucket.QUORUM: self.quorum_s,
        }


def account(
    wall_s: float,
    checkpoint_blocking_s: float,
    interruptions: Iterable[Interruption],
    startup: Startup | None = None,
) -> Goodput:
    """Split ``wall_s`` (from ``startup.started_s``, when given) into productive time and badput. The start-up ends
    at the first productive step, or at the first failure when that came first (its relaunch is the
    interruption's ``detection`` and ``restart``); without a first productive step it lasts until the end."""
    if wall_s < 0 or checkpoint_blocking_s < 0:
        raise ValueError("wall_s and checkpoint_blocking_s must be >= 0")
    interruptions = list(interruptions)
    detection = spare = restart = recompute = startup_s = quorum = 0.0
    for i in interruptions:
        detection += (i.detected_s - i.failed_s) * i.share
        spare += i.spare_wait_s * i.share
        restart += max(0.0, i.resumed_s - i.detected_s - i.spare_wait_s) * i.share
        recompute += i.lost_steps * i.step_time_s * i.share
        recompute += i.discarded_steps * i.step_time_s * (1.0 - i.share)  # the groups it did not stop
        quorum += i.stall_s
    if startup is not None:
        end_s = startup.started_s + wall_s
        first = startup.first_productive_s if startup.first_productive_s is not None else end_s
        ended_s = min([first, end_s, *(i.failed_s for i in interruptions)])
        startup_s = max(0.0, ended_s - startup.started_s)
    bad = startup_s + checkpoint_blocking_s + detection + spare + restart + recompute + quorum
    return Goodput(
        wall_s, max(0.0, wall_s - bad), checkpoint_blocking_s, detection, spare, restart, recompute, startup_s, quorum
    )
