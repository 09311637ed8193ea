"""A discrete-event simulation of a long training run: where its wall-clock time goes under a checkpoint cadence and
a spare pool, for a failure workload (``opsd.analysis.presets``). The model and its assumptions: docs/simulation.md.

The run alternates compute and checkpoints. A checkpoint stops training for ``checkpoint_blocking_s``, then
becomes durable ``checkpoint_background_s`` later (the asynchronous upload); a failure before that falls back to
the checkpoint before it, and a checkpoint due before then first waits for that upload. Failures arrive as a
Poisson process in wall-clock time (during recoveries too); each draws a category from the workload's mix, which
sets its detection delay and whether its node must be swapped. Planned interruptions arrive apart from the failures
(their own random stream, so that they do not change the failures): the job saves, waits until the save is durable,
stops and restarts; nothing is lost, and the time goes to the ``maintenance`` bucket.
A recovery is detection, then waiting for a spare when the pool is empty (failed nodes come back after
``repair_h``), then ``restart_s`` (relaunch and restore). The work done since the durable checkpoint is lost.

Policies, each calling the controller's own code in ``opsd.policy``: a fixed interval, or the adaptive cadence
(``plan_cadence``: the Young/Daly interval from the MTBF observed so far); a fixed spare pool, or the pool the
binomial rule sizes (``spare_pool_size``). Straggler episodes slow the whole job (synchronous training runs at
the pace of its slowest rank) until they end, or until opsd flags the rank and swaps it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from opsd.analysis.presets import CATEGORIES, DETECTION, Category, Detection, Workload
from opsd.analysis.replica_groups import DIES_AT_ONCE, ReplicaGroups
from opsd.analysis.spare_pool import SparePool
from opsd.analysis.stragglers import Stragglers, straggler_badput
from opsd.policy.cadence import Cadence, CadenceConfig, plan_cadence, run_mtbf_s
from opsd.policy.goodput import BadputBucket
from opsd.policy.spares import spare_pool_size

log = logging.getLogger(__name__)

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

    def __post_init__(self) -> None:
        if min(self.checkpoint_blocking_s, self.checkpoint_background_s, self.restart_s) < 0:
            raise ValueError("costs: checkpoint_blocking_s, checkpoint_background_s and restart_s must be >= 0")
        if min(self.heal_s, self.quorum_stall_s) < 0:
            raise ValueError("costs: heal_s and quorum_stall_s must be >= 0")
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
        groups = f", {self.replica_groups} replica groups (min {self.min_replicas})" if self.replica_groups > 1 else ""
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


def binomial_spares(workload: Workload, costs: Costs, risk: float) -> int:
    """The pool the binomial rule sizes for the workload's rate of failures that take a node out."""
    swap_share = _swap_share(workload)
    if workload.failures_per_day * swap_share == 0:
        return 0
    node_mtbf_h = workload.nodes * 24.0 / (workload.failures_per_day * swap_share)
    return spare_pool_size(workload.nodes, costs.repair_h, node_mtbf_h, risk)


def simulate(scenario: Scenario, policy: Policy) -> Result:
    """Run the scenario ``replicas`` times (seeds ``seed``, ``seed + 1``, ...) and sum them."""
    spares = policy.spares
    if spares is None:
        spares = binomial_spares(scenario.workload, scenario.costs, policy.spare_risk)
    totals = dict.fromkeys(BUCKETS, 0.0)
    failures = swaps = checkpoints = planned = replica_recoveries = 0
    interval_sum = mtbf_sum = 0.0
    for replica in range(scenario.replicas):
        one = _Run(scenario, policy, spares, scenario.seed + replica)
        one.run()
        for bucket in BUCKETS:
            totals[bucket] += one.badput[bucket]
        totals[BadputBucket.STRAGGLER] += straggler_badput(
            scenario.stragglers,
            scenario.days,
            swap=policy.swap_stragglers,
            swap_cost_s=scenario.costs.checkpoint_blocking_s + scenario.costs.restart_s,
            seed=scenario.seed + replica,
        )
        failures += one.failures
        swaps += one.swaps
        checkpoints += one.checkpoints
        planned += one.planned
        replica_recoveries += one.groups.recoveries
        interval_sum += one.interval_sum
        mtbf_sum += one.mtbf_estimate_s()
    wall = scenario.days * 86400.0 * scenario.replicas
    mean_interval = interval_sum / checkpoints if checkpoints else math.inf
    return Result(
        policy.describe(),
        wall,
        totals,
        failures,
        swaps,
        spares,
        mean_interval,
        planned=planned,
        mtbf_estimate_s=mtbf_sum / scenario.replicas,
        replica_recoveries=replica_recoveries,
    )


def sweep(
    scenario: Scenario, policy: Policy, intervals_s: Sequence[float], progress: Callable[[], None] | None = None
) -> list[Result]:
    """Fixed intervals over the same failures (the same seeds): a fair comparison."""
    results = []
    for interval in intervals_s:
        results.append(simulate(scenario, _with_interval(policy, interval)))
        if progress is not None:
            progress()
    return results


def log_grid(low_s: float, high_s: float, points: int) -> list[float]:
    if not 0 < low_s < high_s or points < 2:
        raise ValueError("a grid needs 0 < low < high and at least 2 points")
    ratio = (high_s / low_s) ** (1 / (points - 1))
    return [low_s * ratio**i for i in range(points)]


def parse_interval(text: str, step_time_s: float) -> float | None:
    """``adaptive`` (None), seconds (``900``, ``900s``), ``30m``, ``3h``, or ``steps:500``."""
    value = text.strip().lower()
    if value == "adaptive":
        return None
    scale = 1.0
    if value.startswith("steps:"):
        value, scale = value.removeprefix("steps:"), step_time_s
    elif value[-1:] in ("s", "m", "h"):
        value, scale = value[:-1], {"s": 1.0, "m": 60.0, "h": 3600.0}[value[-1]]
    try:
        seconds = float(value) * scale
    except ValueError:
        raise ValueError(f"interval {text!r}: expected adaptive, 900, 900s, 30m, 3h or steps:500") from None
    if not seconds > 0 or math.isinf(seconds):
        raise ValueError(f"interval {text!r} must be > 0")
    return seconds


def _with_interval(policy: Policy, interval_s: float) -> Policy:
    return dataclasses.replace(policy, interval_s=interval_s)


def _swap_share(workload: Workload) -> float:
    total = sum(w for _, w in workload.causes)
    return sum(w for c, w in workload.causes if CATEGORIES[c].swap) / total


class _Run:
    """One run of the event loop; the module docstring describes the model."""

    def __init__(self, scenario: Scenario, policy: Policy, spares: int, seed: int) -> None:
        self.s, self.p, self.c = scenario, policy, scenario.costs
        self.rng = random.Random(seed)
        self.rate_per_s = scenario.workload.failures_per_day / 86400.0
        self.horizon_s = scenario.days * 86400.0
        self.categories = [c for c, _ in scenario.workload.causes]
        self.weights = [w for _, w in scenario.workload.causes]
        self.detect = policy.delays
        self.planned_rng = random.Random(seed ^ 0x9A1D)
        self.planned_per_s = scenario.workload.planned_per_day / 86400.0
        self.pool = SparePool(spares, self.c.repair_h * 3600.0)
        self.badput = dict.fromkeys(BUCKETS, 0.0)
        self.failures = self.swaps = self.checkpoints = self.planned = 0
        self.interval_sum = 0.0
        self.cadence: Cadence | None = None
        self.groups = ReplicaGroups(policy.replica_groups, policy.min_replicas, self.badput)

    def _next_failure(self, after_s: float) -> float:
        return after_s + self.rng.expovariate(self.rate_per_s) if self.rate_per_s > 0 else math.inf

    def _next_planned(self, after_s: float) -> float:
        return after_s + self.planned_rng.expovariate(self.planned_per_s) if self.planned_per_s > 0 else math.inf

    def mtbf_estimate_s(self) -> float:
        """The run's MTBF as the adaptive cadence estimates it from the failures of the whole run."""
        nodes = self.s.workload.nodes
        return run_mtbf_s(self._restoring(), nodes * self.horizon_s / 3600.0, nodes, self.p.cadence)

    def _restoring(self) -> int:
        """The failures that restored a checkpoint: the cadence plans for those (as the controller's does)."""
        return self.failures - self.groups.recoveries

    def _interval(self, t: float, work: float) -> float:
        if self.p.interval_s is not None:
            return self.p.interval_s
        self.cadence = plan_cadence(
            checkpoint_cost_s=self.c.checkpoint_blocking_s,
            step_time_s=self.c.step_time_s,
            current_step=int(work / self.c.step_time_s),
            slowest_step=int(work / self.c.step_time_s),  # one job in step
            failures=self._restoring(),
            node_hours=self.s.workload.nodes * t / 3600.0,
            nodes=self.s.workload.nodes,
            config=self.p.cadence,
            previous=self.cadence,
        )
        return self.cadence.every_steps * self.c.step_time_s

    def run(self) -> None:
        t = work = durable = 0.0
        pending: tuple[float, float] | None = None  # (work saved, when durable)
        fail_t = self._next_failure(0.0)
        plan_t = self._next_planned(0.0)
        interval = self._interval(t, work)
        next_checkpoint = work + interval
        while t < self.horizon_s:
            plan_at = max(plan_t, t)  # a planned stop due during a recovery is taken when the job runs again
            end = min(t + next_checkpoint - work, fail_t, plan_at, self.horizon_s)
            work += end - t
            t = end
            if t >= self.horizon_s:
                break
            if fail_t > t and plan_at > t:  # a checkpoint: training stops, then the upload runs behind
                # a save waits for the upload of the one before it (as an async save does)
                behind = max(0.0, pending[1] - t) if pending is not None else 0.0
                end = min(t + behind + self.c.checkpoint_blocking_s, fail_t, self.horizon_s)
                self.badput[BadputBucket.CHECKPOINT] += end - t
                t = end
                if t < fail_t and t < self.horizon_s:
                    if pending is not None and pending[1] <= t:
                        durable = pending[0]
                    pending = (work, t + self.c.checkpoint_background_s)
                    self.checkpoints += 1
                    self.interval_sum += interval
                    interval = self._interval(t, work)
                    next_checkpoint = work + interval
                    continue
                if t >= self.horizon_s:
                    break
            if pending is not None and pending[1] <= min(t, fail_t):
                durable = pending[0]
            if fail_t > t:  # a planned stop
                t, fail_t, work = self._maintain(t, fail_t, work, durable, pending)
                plan_t = self._next_planned(plan_t)
            else:
                category = self._category()
                if category.signal != "silent" and self.groups.can_recover(t):
                    t, fail_t = self._recover_group(t, category)
                    continue  # the others trained on: nothing restored, the checkpoints go on as planned
                self.groups.stop_all(t)  # a silent corruption is in every replica: back to a checkpoint
                self.badput[BadputBucket.RECOMPUTE] += work - durable
                work = durable
                t, fail_t = self._recover(t, category)
            pending = None
            durable = work
            interval = self._interval(t, work)
            next_checkpoint = work + interval

    def _maintain(
        self, t: float, fail_t: float, work: float, durable: float, pending: tuple[float, float] | None
    ) -> tuple[float, float, float]:
        """A planned stop at ``t``: save, wait until the save is durable, restart. (when the job runs again, its
        next failure, the work it runs from). A failure during the stop falls back to the durable checkpoint."""
        self.planned += 1
        self.groups.stop_all(t)
        behind = max(0.0, pending[1] - t) if pending is not None else 0.0
        durable_at = t + behind + self.c.checkpoint_blocking_s + self.c.checkpoint_background_s
        resume_at = durable_at + self.c.restart_s
        cut = min(fail_t, resume_at, self.horizon_s)
        self.badput[BadputBucket.MAINTENANCE] += cut - t
        if fail_t >= resume_at or fail_t >= self.horizon_s:
            return cut, fail_t, work
        if pending is not None and pending[1] <= fail_t:
            durable = pending[0]
        if durable_at <= fail_t:
            durable = work
        self.badput[BadputBucket.RECOMPUTE] += work - durable
        t, fail_t = self._recover(fail_t)
        return t, fail_t, durable

    def _category(self) -> Category:
        return CATEGORIES[self.rng.choices(self.categories, self.weights)[0]]

    def _detect_and_swap(self, t: float, category: Category) -> tuple[float, float]:
        """A failure at ``t`` counted: (its detection delay, the wait for a spare when it needs one)."""
        self.failures += 1
        detection = self.detect.delay_s(category.signal)
        if not category.swap:
            return detection, 0.0
        self.swaps += 1
        return detection, self.pool.take(t + detection)

    def _recover_group(self, t: float, category: Category) -> tuple[float, float]:
        """A failure at ``t`` recovered by its replica group alone (``opsd.analysis.replica_groups``): (when the
        others train again, the next failure)."""
        detection, wait = self._detect_and_swap(t, category)
        next_fail = self._next_failure(t)
        stall = self.c.quorum_stall_s + (0.0 if category.signal in DIES_AT_ONCE else detection)
        phases = (
            (BadputBucket.DETECTION, detection),
            (BadputBucket.SPARE_WAIT, wait),
            (BadputBucket.RESTART, self.c.heal_s),
        )
        resume = self.groups.fail_one(t, stall, phases, self.horizon_s)
        return resume, max(next_fail, resume)  # a failure during the stall comes as it ends

    def _recover(self, t: float, first: Category | None = None) -> tuple[float, float]:
        """Failures from ``t`` until the job runs again (the first of category ``first``, else drawn): (when it runs
        again, its next failure)."""
        while True:
            category = first or self._category()
            first = None
            detection, wait = self._detect_and_swap(t, category)
            next_fail = self._next_failure(t)
            end = t + detection + wait + self.c.restart_s
            cut = min(next_fail, end, self.horizon_s)
            start = t
            waits = (
                (BadputBucket.DETECTION, detection),
                (BadputBucket.SPARE_WAIT, wait),
                (BadputBucket.RESTART, self.c.restart_s),
            )
            for bucket, length in waits:
                self.badput[bucket] += min(length, max(0.0, cut - start))
                start += length
            if next_fail < end and next_fail < self.horizon_s:
                t = next_fail  # failed again before it ran
                continue
            return cut, next_fail
