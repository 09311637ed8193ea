"""The interval at which agents send their ranks, and the slot of it in which each node sends, as tables of named
cases."""

from __future__ import annotations

import math
from typing import Any

import pytest

from opsd.policy.telemetry import TelemetryConfig, TelemetryPlan, phase_ratio, plan_telemetry, ranks_due

C = TelemetryConfig(heartbeats_per_s=1500, min_interval_s=1, max_interval_s=10, hysteresis_ratio=0.1)

#: (nodes, interval asked for now, hang floor, cadence lead) -> (interval, sample slot)
CASES: dict[str, tuple[tuple[int, float, float, float], tuple[float, float]]] = {
    "no node yet": ((0, 1, 60, 30), (1, 2)),
    "a small job: every second": ((64, 1, 60, 30), (1, 2)),
    "exactly the budget: every second": ((1500, 1, 60, 30), (1, 2)),
    "one node over: every 2 s": ((1501, 1, 60, 30), (2, 2)),
    "Llama 3 scale, 3,072 nodes": ((3072, 1, 60, 30), (3, 3)),
    "12,288 nodes: every 9 s, samples over 9 s": ((12288, 1, 60, 30), (9, 9)),
    "over budget: capped at max_interval_s": ((30000, 1, 60, 30), (10, 10)),
    "a short hang floor caps it at a third": ((12288, 1, 6, 30), (2, 2)),
    "a short cadence lead caps it at a third": ((12288, 1, 60, 12), (4, 4)),
    "a floor under three seconds: never under the minimum": ((12288, 1, 1.5, 30), (1, 2)),
    "longer at once when the nodes grow": ((12288, 3, 60, 30), (9, 9)),
    "not shorter within the margin": ((12000, 9, 60, 30), (9, 9)),
    "shorter once under budget by the margin": ((10000, 9, 60, 30), (8, 8)),
    "shorter by steps, never below the need": ((3000, 9, 60, 30), (3, 3)),
    "a node count at a boundary stays": ((2990, 3, 60, 30), (3, 3)),
    "from above the cap down to it": ((30000, 20, 60, 30), (10, 10)),
}

#: (nodes heard, nodes by the jobs' world size, interval asked for now) -> interval
EXPECTED: dict[str, tuple[tuple[int, int, float], float]] = {
    "a 12,288-node job's first node: every 9 s at once": ((1, 12288, 1), 9),
    "half of its nodes heard: still 9 s": ((6144, 12288, 9), 9),
    "no world size said: the nodes heard": ((3000, 0, 1), 2),
    "more nodes heard than the jobs span (agents of other jobs): those": ((12288, 64, 1), 9),
    "a job that shrank: shorter within the margin only": ((9000, 10000, 9), 8),
    "a small job: every second": ((2, 2, 1), 1),
}


def plan(**given: Any) -> TelemetryPlan:
    """``plan_telemetry`` with a 2 s sample slot, a 60 s hang floor and a 30 s cadence lead unless given."""
    return plan_telemetry(**{"sample_slot_s": 2.0, "hang_floor_s": 60, "cadence_lead_s": 30, **given}, config=C)


@pytest.mark.parametrize(("given", "expected"), list(CASES.values()), ids=list(CASES))
def test_plan_telemetry(given: tuple[int, float, float, float], expected: tuple[float, float]) -> None:
    nodes, current_s, hang_floor_s, lead_s = given
    planned = plan(nodes=nodes, current_interval_s=current_s, hang_floor_s=hang_floor_s, cadence_lead_s=lead_s)
    assert isinstance(planned, TelemetryPlan)
    assert (planned.interval_s, planned.sample_slot_s) == expected
    assert f"every {planned.interval_s:g} s" in planned.reason


@pytest.mark.parametrize(("given", "expected"), list(EXPECTED.values()), ids=list(EXPECTED))
def test_plan_telemetry_for_the_jobs_world_size(given: tuple[int, int, float], expected: float) -> None:
    nodes, expected_nodes, current_s = given
    planned = plan(nodes=nodes, expected_nodes=expected_nodes, current_interval_s=current_s)
    assert planned.interval_s == expected
    assert ("world size" in planned.reason) == (expected_nodes > nodes)


def test_the_budget_holds_on_average_up_to_the_cap() -> None:
    """For every node count up to where the cap binds, the heartbeats a second are within the budget."""
    current = 1.0
    for nodes in range(0, 15001, 37):
        plan = plan_telemetry(
            nodes=nodes, current_interval_s=current, sample_slot_s=2.0, hang_floor_s=60, cadence_lead_s=30, config=C
        )
        assert nodes / plan.interval_s <= C.heartbeats_per_s
        current = plan.interval_s


def test_over_budget_says_so() -> None:
    plan = plan_telemetry(
        nodes=30000, current_interval_s=1, sample_slot_s=2.0, hang_floor_s=60, cadence_lead_s=30, config=C
    )
    assert "over budget" in plan.reason


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"heartbeats_per_s": 0}, "heartbeats_per_s must be > 0"),
        ({"min_interval_s": 0}, "min_interval_s must be > 0"),
        ({"min_interval_s": 11, "max_interval_s": 10}, "<= telemetry.max_interval_s"),
        ({"hysteresis_ratio": 1.0}, "hysteresis_ratio must be in"),
    ],
)
def test_telemetry_config_validates_itself(config: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TelemetryConfig(**config)


#: (now, last delivered, interval, phase) -> due; the node's slots begin at phase x interval past each multiple of
#: the interval (phase 0.5 of 9 s: at ..., 103.5, 112.5, 121.5 s)
DUE: dict[str, tuple[tuple[float, float, float, float], bool]] = {
    "nothing delivered yet": ((100.0, -math.inf, 9.0, 0.5), True),
    "within the slot it was delivered in": ((108.0, 104.6, 9.0, 0.5), False),
    "its next slot has begun": ((113.6, 104.6, 9.0, 0.5), True),
    "a slot begins right after a late delivery": ((112.6, 112.4, 9.0, 0.5), True),
    "delivered just after its slot began: a whole interval": ((121.4, 112.6, 9.0, 0.5), False),
    "several slots missed: due once": ((200.0, 104.6, 9.0, 0.5), True),
    "phase 0: slots on multiples of the interval": ((18.0, 9.5, 9.0, 0.0), True),
    "phase 0, same slot": ((17.9, 9.5, 9.0, 0.0), False),
}


@pytest.mark.parametrize(("given", "expected"), list(DUE.values()), ids=list(DUE))
def test_ranks_due(given: tuple[float, float, float, float], expected: bool) -> None:
    now_s, delivered_s, interval_s, phase = given
    assert ranks_due(now_s=now_s, delivered_s=delivered_s, interval_s=interval_s, phase_ratio=phase) is expected


def test_ranks_due_refuses_what_has_no_slot() -> None:
    with pytest.raises(ValueError, match="interval_s must be > 0 and phase_ratio in"):
        ranks_due(now_s=1.0, delivered_s=0.0, interval_s=0.0, phase_ratio=0.5)
    with pytest.raises(ValueError, match="phase_ratio in"):
        ranks_due(now_s=1.0, delivered_s=0.0, interval_s=9.0, phase_ratio=1.0)


def test_a_nodes_phase_is_its_own_and_the_same_everywhere() -> None:
    assert phase_ratio("node-00042") == phase_ratio("node-00042")  # no per-process hash seed
    assert 0.0 <= phase_ratio("node-00042") < 1.0
    assert phase_ratio("node-00042") != phase_ratio("node-00043")


def test_nodes_answered_at_once_spread_over_the_interval() -> None:
    """12,288 nodes whose replies all came back in the same second (a controller that stalled) and that check every
    beat at their own phase of the second: over the next intervals each sends once per interval, and no second holds
    much more than an even share (1,365 a second at 9 s). Counting from the last delivery instead, every node would
    send in the same second, every interval."""
    nodes, interval_s, start_s = 12288, 9.0, 1_800_000_000.0
    phases = [phase_ratio(f"node-{i:05d}") for i in range(nodes)]
    delivered = [start_s + i / nodes for i in range(nodes)]  # all within one second
    per_second = [0] * 27
    for second in range(1, 28):
        for i in range(nodes):
            now_s = start_s + second + i / nodes  # node i beats at its phase of each second
            if ranks_due(now_s=now_s, delivered_s=delivered[i], interval_s=interval_s, phase_ratio=phases[i]):
                delivered[i] = now_s
                per_second[second - 1] += 1
    assert sum(per_second[9:]) == 2 * nodes  # once an interval each, once settled
    assert max(per_second) <= 1.2 * nodes / interval_s
