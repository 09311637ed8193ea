"""What the goodput simulation (``opsd.analysis.simulation``) is given and gives: the costs of its events, the policy
under test, the scenario, and the result (docs/simulation.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from opsd.analysis.presets import DETECTION, Detection, Workload
from opsd.analysis.stragglers import Stragglers
from opsd.policy.cadence import CadenceConfig
from opsd.policy.goodput import BadputBucket

#: the simulator's badput buckets, in the order reports show them
BUCKETS = (
    BadputBucket.CHECKPOINT,
    BadputBucket.RECOMPUTE,
    BadputBucket.DETECTION,
    BadputBucket.SPARE_WAIT,
    BadputBucket.RESTART,
    BadputBucket.STRAGGLER,
    BadputBucket.MAINTENANCE,
    BadputBucket.QUORUM,
)


@dataclass(frozen=True)
class Costs:
    checkpoint_blocking_s: float = 1.0  # training stops this long per checkpoint
    checkpoint_background_s: float = 30.0  # then the checkpoint is durable this much later
    restart_s: float = 120.0  # relaunch and restore, a spare in hand
    repair_h: float = 24.0  # a failed node is back in the pool this much later
    step_time_s: float = 5.0
    heal_s: float = 120.0  # a replica group relaunched alone, a spare in hand, to its first step in the quorum
    quorum_stall_s: float = 2.1  # the other groups' stall once a failed group died (1.05 x a 2 s heartbeat timeout)
    # the fault-tolerant groups on NCCL (docs/simulation.md): the other groups wait on a failed group in their
    # collective until opsd's word reaches them (``signal_s`` after its detection) or until its timeout
    collective_timeout_s: float = 60.0  # torchft's collective timeout
    signal_s: float = 1.0  # from a detection to the other groups' ranks: a heartbeat's reply, the rank's poll
    communicator_rebuild_s: float = 5.0  # every group, at each change of the quorum: a new communicator across them
    heal_transfer_s: float = 2.4  # a group rejoining reads a peer's state; the others wait for it in their collective

    def __post_init__(self) -> None:
        if min(self.checkpoint_blocking_s, self.checkpoint_background_s, self.restart_s) < 0:
            raise ValueError("costs: checkpoint_blocking_s, checkpoint_background_s and restart_s must be >= 0")
        if min(self.heal_s, self.quorum_stall_s, self.signal_s, self.communicator_rebuild_s, self.heal_transfer_s) < 0:
            raise ValueError("costs: heal_s, quorum_stall_s, signal_s, communicator_rebuild_s, heal_transfer_s >= 0")
        if self.collective_timeout_s <= 0:
            raise ValueError("costs.collective_timeout_s must be > 0")
        if self.repair_h <= 0 or self.step_time_s <= 0:
            raise ValueError("costs.repair_h and costs.step_time_s must be > 0")


@dataclass(frozen=True)
class Policy:
    interval_s: float | None = None  # a fixed checkpoint interval; None: the adaptive cadence
    spares: int | None = None  # a fixed pool; None: sized by the binomial rule
    detection: str | Detection = "opsd"  # a detection model of opsd.analysis.presets.DETECTION, or delays
    swap_stragglers: bool = True
    spare_risk: float = 0.001  # the binomial rule's P(more failures than spares in one repair window)
    cadence: CadenceConfig = field(default_factory=CadenceConfig)
    replica_groups: int = 1  # fault-tolerant replica groups (docs/ft.md); 1: every failure restarts the whole job
    min_replicas: int = 1  # the fewest groups a quorum has: a failure that leaves fewer restarts the whole job
    survivors_told: bool = True  # opsd names a failed group to the others, who stop waiting on it (docs/ft.md)

    def __post_init__(self) -> None:
        if self.interval_s is not None and self.interval_s <= 0:
            raise ValueError("policy.interval_s must be > 0")
        if self.spares is not None and self.spares < 0:
            raise ValueError("policy.spares must be >= 0")
        if isinstance(self.detection, str) and self.detection not in DETECTION:
            raise ValueError(f"policy.detection must be one of {', '.join(DETECTION)}")
        if not 0 < self.spare_risk < 1:
            raise ValueError("policy.spare_risk must be between 0 and 1")
        if not 1 <= self.min_replicas <= self.replica_groups:
            raise ValueError("policy: 1 <= min_replicas <= replica_groups")

    def describe(self) -> str:
        interval = "adaptive" if self.interval_s is None else f"every {self.interval_s:.0f} s"
        spares = "binomial" if self.spares is None else str(self.spares)
        detection = self.detection if isinstance(self.detection, str) else "custom"
        told = "" if self.survivors_told else ", the others not told"
        groups = (
            f", {self.replica_groups} replica groups (min {self.min_replicas}{told})" if self.replica_groups > 1 else ""
        )
        return f"checkpoint {interval}, spares {spares}, detection {detection}{groups}"

    @property
    def delays(self) -> Detection:
        return DETECTION[self.detection] if isinstance(self.detection, str) else self.detection


@dataclass(frozen=True)
class Scenario:
    workload: Workload
    days: float
    costs: Costs = field(default_factory=Costs)
    stragglers: Stragglers = field(default_factory=Stragglers)
    seed: int = 0
    replicas: int = 1  # independent runs, summed: less noise

    def __post_init__(self) -> None:
        if self.days <= 0 or self.replicas < 1:
            raise ValueError("scenario.days must be > 0 and scenario.replicas >= 1")


@dataclass(frozen=True)
class Result:
    policy: str
    wall_s: float
    badput_s: dict[BadputBucket, float]  # BUCKETS
    failures: int
    swaps: int
    spares: int
    mean_interval_s: float  # the checkpoint intervals used, weighted by the checkpoints taken
    planned: int = 0  # planned interruptions
    mtbf_estimate_s: float = math.inf  # the adaptive cadence's MTBF estimate at the end of a run, mean over runs
    replica_recoveries: int = 0  # failures recovered by their replica group alone (the others trained on)

    @property
    def productive_s(self) -> float:
        return self.wall_s - sum(self.badput_s.values())

    @property
    def ettr(self) -> float:
        return self.productive_s / self.wall_s

    @property
    def lost_work_per_failure_s(self) -> float:
        """Work done again per failure (the time since the durable checkpoint)."""
        return self.badput_s[BadputBucket.RECOMPUTE] / self.failures if self.failures else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "policy": self.policy,
            "ettr": self.ettr,
            "wall_s": self.wall_s,
            "productive_s": self.productive_s,
            "badput_s": dict(self.badput_s),
            "failures": self.failures,
            "swaps": self.swaps,
            "spares": self.spares,
            "mean_interval_s": self.mean_interval_s,
            "lost_work_per_failure_s": self.lost_work_per_failure_s,
            "planned": self.planned,
            "mtbf_estimate_s": self.mtbf_estimate_s,
            "replica_recoveries": self.replica_recoveries,
        }


def survivors_stall_s(costs: Costs, detection_s: float, told: bool) -> float:
    """The other groups' stall when a replica group fails (on NCCL, a dead or hung peer holds its peers' collective):
    they wait on it until opsd's word reaches them (``told``: its detection and ``signal_s``) or until their
    collective's timeout, and for the quorum without it (the Lighthouse's heartbeat timeout, meanwhile), then for a
    new communicator."""
    held_s = min(detection_s + costs.signal_s, costs.collective_timeout_s) if told else costs.collective_timeout_s
    return max(held_s, costs.quorum_stall_s) + costs.communicator_rebuild_s
