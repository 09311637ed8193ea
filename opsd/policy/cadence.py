"""MTBF from the incident history, and the checkpoint cadence it implies (Young/Daly), published in steps.

Pure: counts, hours and seconds in; numbers and a ``Cadence`` out. No clocks.

- MTBF: failures per node-hour with a Gamma prior (a conjugate Gamma-Poisson estimate): the prior is worth
  ``prior_node_hours`` of operation at ``prior_mtbf_node_h`` hours between failures per node, so that a young run
  does not conclude from two lucky days that nodes never fail. The run's MTBF is the node MTBF divided by its
  node count (failures of independent nodes add up).
- Interval: Daly's higher-order optimum (J. T. Daly, "A higher order estimate of the optimum checkpoint interval
  for restart dumps", FGCS 2006): tau = sqrt(2 d M) [1 + (1/3) sqrt(d / 2M) + (1/9) (d / 2M)] - d for d < 2M,
  else M; d is the checkpoint's cost (the time it stops training), M the run's MTBF. Young's first-order
  sqrt(2 d M) (J. W. Young, CACM 1974) is its leading term. Bounded by ``min_interval_s`` / ``max_interval_s``.
- Steps: the interval over the observed step time, at least 1, published as "every K steps from step E" with E
  far enough ahead (``lead_s``, at least ``min_lead_steps``) that every node has the new policy before it.
- Never replaced before it is in force: the policy carries the new cadence and the one before it (``previous``),
  nothing older. A cadence replaced while its own E is ahead of some rank would take the one in force with it:
  the steps up to E would fall back to the ranks' local cadence, now, on each rank as its node's file changes,
  and a rank that saves while its peer does not waits in the save's collective for good (a hang). So a published
  cadence stays until every rank has reported a step past its E (``slowest_step``).
- Never shorter than the write: an asynchronous save keeps writing after training resumed, and a save due while
  the previous one is still writing is skipped (``trainer_hooks.checkpoint``). The interval is at least the
  measured write time (a save's start to its commit, ``write_s``), so that a cadence never asks for saves that
  would be skipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class CadenceConfig:
    prior_mtbf_node_h: float = 5000.0  # hours between failures of one node, before evidence
    prior_node_hours: float = 50000.0  # how much evidence the prior is worth (node-hours)
    min_interval_s: float = 60.0
    max_interval_s: float = 4 * 3600.0
    lead_s: float = 30.0  # a new cadence takes effect this far ahead of the current step
    min_lead_steps: int = 5
    change_ratio: float = 0.2  # republish only when K moves by more than this fraction

    def __post_init__(self) -> None:
        if self.prior_mtbf_node_h <= 0 or self.prior_node_hours <= 0:
            raise ValueError("cadence.prior_mtbf_node_h and cadence.prior_node_hours must be > 0")
        if not 0 < self.min_interval_s <= self.max_interval_s:
            raise ValueError("cadence.min_interval_s must be > 0 and <= cadence.max_interval_s")
        if self.lead_s < 0 or self.min_lead_steps < 1:
            raise ValueError("cadence.lead_s must be >= 0 and cadence.min_lead_steps >= 1")
        if self.change_ratio < 0:
            raise ValueError("cadence.change_ratio must be >= 0")


def node_failure_rate_per_h(failures: int, node_hours: float, config: CadenceConfig) -> float:
    """Posterior mean failures per node-hour: (prior failures + failures) / (prior node-hours + node-hours)."""
    if failures < 0 or node_hours < 0:
        raise ValueError("failures and node_hours must be >= 0")
    prior_failures = config.prior_node_hours / config.prior_mtbf_node_h
    return (prior_failures + failures) / (config.prior_node_hours + node_hours)


def run_mtbf_s(failures: int, node_hours: float, nodes: int, config: CadenceConfig) -> float:
    """The run's mean time between failures, in seconds, for ``nodes`` nodes."""
    if nodes < 1:
        raise ValueError("nodes must be >= 1")
    return 3600.0 / (node_failure_rate_per_h(failures, node_hours, config) * nodes)


def young_interval_s(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Young (1974): sqrt(2 d M)."""
    return math.sqrt(2.0 * checkpoint_cost_s * mtbf_s)


def daly_interval_s(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Daly (2006), unbounded; see the module docstring."""
    if checkpoint_cost_s < 0 or mtbf_s <= 0:
        raise ValueError("checkpoint_cost_s must be >= 0 and mtbf_s > 0")
    if checkpoint_cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = checkpoint_cost_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * checkpoint_cost_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - checkpoint_cost_s


def interval_s(checkpoint_cost_s: float, mtbf_s: float, config: CadenceConfig) -> float:
    """Daly's interval within the configured bounds."""
    return min(config.max_interval_s, max(config.min_interval_s, daly_interval_s(checkpoint_cost_s, mtbf_s)))


@dataclass(frozen=True)
class Cadence:
    every_steps: int
    from_step: int
    interval_s: float  # the interval the steps were computed from
    mtbf_s: float
    reason: str  # one line: the inputs and the rule


def plan_cadence(
    *,
    checkpoint_cost_s: float,
    step_time_s: float,
    current_step: int,
    slowest_step: int,
    failures: int,
    node_hours: float,
    nodes: int,
    config: CadenceConfig,
    previous: Cadence | None = None,
    write_s: float = 0.0,
) -> Cadence:
    """The cadence to publish now, never more often than a save takes to be written (``write_s``: the measured
    time from a save's start to its commit). ``current_step``: the newest step a rank reported; ``slowest_step``:
    the newest step every rank reported. Keeps ``previous`` (same K, same E) until every rank is past its E, then
    unless K changes by more than ``change_ratio``, so that agents and ranks are not sent a new schedule every
    heartbeat."""
    if step_time_s <= 0:
        raise ValueError("step_time_s must be > 0")
    if write_s < 0:
        raise ValueError("write_s must be >= 0")
    if previous is not None and slowest_step <= previous.from_step:
        return previous  # not in force on every rank yet: replacing it would change the steps they decide now
    mtbf = run_mtbf_s(failures, node_hours, nodes, config)
    tau = interval_s(checkpoint_cost_s, mtbf, config)
    every = max(1, round(tau / step_time_s))
    floor = math.ceil(write_s / step_time_s)
    if previous is not None:
        small_move = abs(every - previous.every_steps) <= config.change_ratio * previous.every_steps
        if small_move and min(every, previous.every_steps) >= floor:  # and both leave the write time
            return previous
    lead = max(config.min_lead_steps, math.ceil(config.lead_s / step_time_s))
    reason = (
        f"MTBF {mtbf / 3600:.2f} h ({failures} failures in {node_hours:.0f} node-hours, {nodes} nodes), checkpoint "
        f"cost {checkpoint_cost_s:.2f} s -> Daly interval {tau:.0f} s = {every} steps of {step_time_s:.3f} s"
    )
    if floor > every:
        reason += f"; a save takes {write_s:.1f} s to write: every {floor} steps, no sooner"
        every = floor
    return Cadence(every, current_step + lead, tau, mtbf, reason)
