"""How often agents send their ranks: the interval the controller asks for in its heartbeat replies, so that the
heartbeats with ranks stay within what it plans to take a second, however many nodes there are.

Pure: counts and seconds in, a ``TelemetryPlan`` out. No clocks.

An agent says it is alive every second by a datagram (``opsd.protocol.liveness``) and sends a heartbeat with its
ranks, their steps and sums, every ``interval_s``; a node's liveness does not depend on it. The interval:

- ``nodes / heartbeats_per_s`` rounded up to whole seconds, at least ``min_interval_s``: at most the budget of
  heartbeats a second on average (12,288 nodes at 1,500 a second: every 9 s). The nodes are those heard from, or
  those the running jobs span by their ranks' world size (``expected_nodes``), the more: when 12,288 nodes start,
  the first reply asks for 9 s. Planned from the nodes heard alone, the interval climbed a step at a time over a
  minute or more while the first contacts came in, the nodes answered first sent their ranks every 2, 3, 4 s
  meanwhile, and each step made every node send once more within an interval (a new grid of slots): at the start
  the controller took twice its budget and more, which put its first contacts off further;
- at most a third of the hang floor (a rank's progress is seen up to an interval late; a hang is never found in
  less than the floor, and never more than a third of it later) and a third of the cadence's lead (a new cadence
  is planned from a newest step up to an interval old, and reaches the nodes up to an interval later: both within
  the lead, with a margin), and at most ``max_interval_s``;
- shortened only once the load is ``hysteresis_ratio`` under the budget at the shorter interval, so that a node
  count near a boundary does not make it go back and forth.

Each node sends its ranks in a slot of the interval of its own (``phase_ratio``, from its name), not an interval
after its last delivery: when a controller stalls (a takeover, a start of thousands of nodes), the replies held up
come back together, and agents that counted from them would send together from then on, every interval, a second's
worth of a whole interval's heartbeats (at 12,288 nodes, several thousand in one second, and then a backlog that
makes the next cohort). ``ranks_due`` is the agents' rule.

Compute samples are compared among peers within slots of time: a slot at least as long as the interval holds a
sample of every rank (shorter ones would hold an ever smaller share of the peers), so ``sample_slot_s`` is the
configured slot or the interval, the longer.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TelemetryConfig:
    heartbeats_per_s: float = 1500.0  # heartbeats with ranks the controller plans to take a second, on average
    min_interval_s: float = 1.0
    max_interval_s: float = 10.0
    hysteresis_ratio: float = 0.1  # a shorter interval once the load would be this much under the budget

    def __post_init__(self) -> None:
        if self.heartbeats_per_s <= 0:
            raise ValueError("telemetry.heartbeats_per_s must be > 0")
        if not 0 < self.min_interval_s <= self.max_interval_s:
            raise ValueError("telemetry.min_interval_s must be > 0 and <= telemetry.max_interval_s")
        if not 0 <= self.hysteresis_ratio < 1:
            raise ValueError("telemetry.hysteresis_ratio must be in [0, 1)")


@dataclass(frozen=True)
class TelemetryPlan:
    interval_s: float  # agents send their ranks this often
    sample_slot_s: float  # compute samples are compared within slots this long
    reason: str


def _whole_s(seconds: float) -> float:
    """Seconds rounded up to a whole number (a hair over one is not two)."""
    return float(math.ceil(seconds - 1e-9))


def plan_telemetry(
    *,
    nodes: int,
    expected_nodes: int = 0,
    current_interval_s: float,
    sample_slot_s: float,
    hang_floor_s: float,
    cadence_lead_s: float,
    config: TelemetryConfig,
) -> TelemetryPlan:
    """The interval for ``nodes`` nodes heard from, or the ``expected_nodes`` of the running jobs' world sizes when
    more, given the interval asked for now."""
    if nodes < 0 or expected_nodes < 0 or current_interval_s <= 0 or sample_slot_s <= 0:
        raise ValueError("nodes and expected_nodes must be >= 0, current_interval_s and sample_slot_s > 0")
    cap = max(config.min_interval_s, min(config.max_interval_s, hang_floor_s / 3, cadence_lead_s / 3))
    count = max(nodes, expected_nodes)
    need_s = count / config.heartbeats_per_s
    interval = min(cap, max(config.min_interval_s, _whole_s(need_s)))
    why = f"{count} nodes at {config.heartbeats_per_s:g} heartbeats/s"
    if expected_nodes > nodes:
        why = f"{count} nodes by the jobs' world size ({nodes} heard) at {config.heartbeats_per_s:g} heartbeats/s"
    if interval < current_interval_s:
        # shorter only as far as the budget holds with the margin
        margin = min(cap, max(config.min_interval_s, _whole_s(need_s / (1 - config.hysteresis_ratio))))
        interval = max(interval, min(current_interval_s, margin))
    if interval == cap and _whole_s(need_s) > cap:
        why += f", capped at {cap:g} s (over budget)"
    return TelemetryPlan(interval, max(sample_slot_s, interval), f"{why}: every {interval:g} s")


def phase_ratio(node: str) -> float:
    """Where in each interval ``node`` sends its ranks, in [0, 1): from a hash of its name, so the same in every
    process, every restart of its agent and every interval, and spread evenly over a job's nodes."""
    digest = hashlib.blake2b(node.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 11) / 2.0**53  # 53 bits: exact in a float, so never 1.0


def ranks_due(*, now_s: float, delivered_s: float, interval_s: float, phase_ratio: float) -> bool:
    """Whether a heartbeat with the ranks is due at ``now_s``: the node's slots begin at ``phase_ratio *
    interval_s`` past each multiple of the interval (wall-clock seconds), and one is due once a slot has begun since
    the last delivered at ``delivered_s`` (``-inf``: none yet, due). A node checking every beat thus sends once an
    interval, at the first beat of its slot, whenever its last heartbeat came back."""
    if interval_s <= 0 or not 0.0 <= phase_ratio < 1.0:
        raise ValueError("interval_s must be > 0 and phase_ratio in [0, 1)")
    if not math.isfinite(delivered_s):
        return True
    offset_s = phase_ratio * interval_s
    return math.floor((now_s - offset_s) / interval_s) > math.floor((delivered_s - offset_s) / interval_s)
