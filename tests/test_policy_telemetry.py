"""The interval at which agents send their ranks, as a table of named cases."""

from __future__ import annotations

import pytest

from opsd.policy.telemetry import TelemetryConfig, TelemetryPlan, plan_telemetry

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


@pytest.mark.parametrize(("given", "expected"), list(CASES.values()), ids=list(CASES))
def test_plan_telemetry(given: tuple[int, float, float, float], expected: tuple[float, float]) -> None:
    nodes, current_s, hang_floor_s, lead_s = given
    plan = plan_telemetry(
        nodes=nodes,
        current_interval_s=current_s,
        sample_slot_s=2.0,
        hang_floor_s=hang_floor_s,
        cadence_lead_s=lead_s,
        config=C,
    )
    assert isinstance(plan, TelemetryPlan)
    assert (plan.interval_s, plan.sample_slot_s) == expected
    assert f"every {plan.interval_s:g} s" in plan.reason


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
