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

from opsd.analysis.presets import CATEGORIES, Category, Workload
from opsd.analysis.replica_groups import ReplicaGroups
from opsd.analysis.scenario import BUCKETS as BUCKETS
from opsd.analysis.scenario import Costs as Costs
from opsd.analysis.scenario import Policy as Policy
from opsd.analysis.scenario import Result as Result
from opsd.analysis.scenario import Scenario as Scenario
from opsd.analysis.scenario import survivors_stall_s
from opsd.analysis.spare_pool import SparePool
from opsd.analysis.stragglers import straggler_badput
from opsd.policy.cadence import Cadence, plan_cadence, run_mtbf_s
from opsd.policy.goodput import BadputBucket
from opsd.policy.spares import spare_pool_size

log = logging.getLogger(__name__)


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
            back_at = max(self.groups.next_back_s(), t)  # a replica group back: every group waits for its heal
            end = min(t + next_checkpoint - work, fail_t, plan_at, back_at, self.horizon_s)
            work += end - t
            t = end
            if t >= self.horizon_s:
                break
            if back_at <= t < min(fail_t, plan_at) and self.groups.rejoin(t):
                t = self._stall(t, self.c.heal_transfer_s + self.c.communicator_rebuild_s, fail_t)
                continue
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
                alone = category.signal != "silent" and not category.spans_groups  # a silent corruption is in all
                if alone and self.groups.can_recover(t):
                    t, fail_t = self._recover_group(t, category)
                    continue  # the others trained on: nothing restored, the checkpoints go on as planned
                self.groups.stop_all(t)  # back to a checkpoint, every group
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
        stall = survivors_stall_s(self.c, detection, self.p.survivors_told)
        phases = (
            (BadputBucket.DETECTION, detection),
            (BadputBucket.SPARE_WAIT, wait),
            (BadputBucket.RESTART, self.c.heal_s),
        )
        resume = self.groups.fail_one(t, stall, phases, self.horizon_s)
        return resume, max(next_fail, resume)  # a failure during the stall comes as it ends

    def _stall(self, t: float, length_s: float, fail_t: float) -> float:
        """Every group waits ``length_s`` from ``t`` (the ``quorum`` bucket), cut by a failure or the run's end."""
        end = min(t + length_s, fail_t, self.horizon_s)
        self.badput[BadputBucket.QUORUM] += end - t
        return end

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
