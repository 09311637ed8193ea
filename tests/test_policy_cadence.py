"""MTBF and the Young/Daly checkpoint cadence, as tables of named cases."""

from __future__ import annotations

import math

import pytest

from opsd.policy.cadence import (
    Cadence,
    CadenceConfig,
    daly_interval_s,
    interval_s,
    plan_cadence,
    run_mtbf_s,
    young_interval_s,
)
from opsd.protocol.policy_file import Cadence as PublishedCadence
from opsd.protocol.policy_file import CheckpointCadence, Policy

C = CadenceConfig(prior_mtbf_node_h=1000, prior_node_hours=1000)  # the prior is worth one prior failure


@pytest.mark.parametrize(
    ("failures", "node_hours", "nodes", "mtbf_h"),
    [
        (0, 0, 1, 1000.0),  # the prior alone: 1 failure in 1000 node-hours
        (0, 0, 100, 10.0),  # 100 nodes fail 100 times as often
        (9, 1000, 1, 200.0),  # (1 + 9) failures in (1000 + 1000) node-hours
        (0, 9000, 1, 10000.0),  # a long quiet history pulls the MTBF up
        (999, 0, 1, 1.0),  # many failures in no time
    ],
    ids=["prior", "scaled-by-nodes", "evidence", "quiet", "storm"],
)
def test_run_mtbf(failures: int, node_hours: float, nodes: int, mtbf_h: float) -> None:
    assert run_mtbf_s(failures, node_hours, nodes, C) / 3600 == pytest.approx(mtbf_h)


@pytest.mark.parametrize(
    ("cost_s", "mtbf_s", "young_s", "daly_s"),
    [
        (60, 3 * 3600, math.sqrt(2 * 60 * 10800), None),  # Daly within ~1% of Young when d << M
        (600, 600, math.sqrt(2 * 600 * 600), None),
        (2000, 900, None, 900),  # d >= 2M: checkpoint every M
        (0, 3600, 0.0, 0.0),  # free checkpoints: as often as possible (bounded by the config)
    ],
    ids=["llama-like", "expensive", "d-over-2M", "free"],
)
def test_young_and_daly(cost_s: float, mtbf_s: float, young_s: float | None, daly_s: float | None) -> None:
    daly = daly_interval_s(cost_s, mtbf_s)
    if young_s is not None:
        assert young_interval_s(cost_s, mtbf_s) == pytest.approx(young_s)
    if daly_s is not None:
        assert daly == pytest.approx(daly_s)
    if cost_s and cost_s < 2 * mtbf_s:
        x = cost_s / (2 * mtbf_s)
        assert daly == pytest.approx(math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - cost_s)


def test_daly_is_the_optimum_of_the_expected_waste() -> None:
    """Against a sweep of the exact expected waste for exponential failures (Daly 2006, eq. 20), the formula's
    interval is within 5% of the best one."""
    cost_s, mtbf_s, restart_s = 120.0, 4 * 3600.0, 300.0

    def wall_per_work(tau: float) -> float:
        return mtbf_s * math.exp(restart_s / mtbf_s) * (math.exp((tau + cost_s) / mtbf_s) - 1) / tau

    sweep = [60.0 * k for k in range(5, 200)]
    best = min(sweep, key=wall_per_work)
    assert daly_interval_s(cost_s, mtbf_s) == pytest.approx(best, rel=0.05)


def test_interval_is_bounded() -> None:
    config = CadenceConfig(min_interval_s=300, max_interval_s=3600)
    assert interval_s(0.01, 100, config) == 300
    assert interval_s(600, 10**9, config) == 3600


# 4 nodes under the prior C: MTBF 250 h = 900,000 s; a 2 s checkpoint -> Daly interval 1896.1 s
CASES: dict[str, tuple[float, int, int, Cadence | None, tuple[int, int]]] = {
    # name: (step_time_s, current_step, slowest_step, previous, (every_steps, from_step))
    "fresh: lead of 30 s ahead": (1.0, 100, 99, None, (1896, 130)),
    "slow steps: lead at least 5 steps": (60.0, 7, 7, None, (32, 12)),
    "previous kept when K barely moves": (1.0, 500, 499, Cadence(1800, 130, 0.0, 0.0, "kept"), (1800, 130)),
    "previous replaced when K moves > 20%": (1.0, 500, 499, Cadence(1000, 130, 0.0, 0.0, "old"), (1896, 530)),
    "previous kept until every rank is past its E": (1.0, 500, 130, Cadence(1000, 130, 0.0, 0.0, "old"), (1000, 130)),
    "previous not yet in force anywhere: kept": (1.0, 100, 99, Cadence(1000, 130, 0.0, 0.0, "old"), (1000, 130)),
}


@pytest.mark.parametrize(
    ("step_time_s", "current_step", "slowest_step", "previous", "expected"), CASES.values(), ids=CASES.keys()
)
def test_plan_cadence(
    step_time_s: float, current_step: int, slowest_step: int, previous: Cadence | None, expected: tuple[int, int]
) -> None:
    config = CadenceConfig(prior_mtbf_node_h=1000, prior_node_hours=1000, min_interval_s=1, lead_s=30)
    cadence = plan_cadence(
        checkpoint_cost_s=2.0,
        step_time_s=step_time_s,
        current_step=current_step,
        slowest_step=slowest_step,
        failures=0,
        node_hours=0,
        nodes=4,
        config=config,
        previous=previous,
    )
    assert (cadence.every_steps, cadence.from_step) == expected
    if cadence is not previous:
        assert cadence.mtbf_s == pytest.approx(900_000)
        assert "Daly interval 1896 s" in cadence.reason


WRITES: dict[str, tuple[float, Cadence | None, int]] = {
    # name: (write_s, previous, every_steps): 1 s steps, a Daly interval of 1896 steps
    "a quick write changes nothing": (30.0, None, 1896),
    "a write longer than the interval sets it": (2500.0, None, 2500),
    "a partial step of writing is a whole step": (2500.5, None, 2501),
    "a previous cadence shorter than the write is replaced": (2000.0, Cadence(1896, 130, 0.0, 0.0, "old"), 2000),
    "a previous cadence the write fits in is kept": (1500.0, Cadence(1800, 130, 0.0, 0.0, "kept"), 1800),
}


@pytest.mark.parametrize(("write_s", "previous", "every_steps"), WRITES.values(), ids=WRITES.keys())
def test_the_interval_is_never_shorter_than_the_write(
    write_s: float, previous: Cadence | None, every_steps: int
) -> None:
    config = CadenceConfig(prior_mtbf_node_h=1000, prior_node_hours=1000, min_interval_s=1, lead_s=30)
    cadence = plan_cadence(
        checkpoint_cost_s=2.0,
        step_time_s=1.0,
        current_step=500,
        slowest_step=500,
        failures=0,
        node_hours=0,
        nodes=4,
        config=config,
        previous=previous,
        write_s=write_s,
    )
    assert cadence.every_steps == every_steps
    assert ("no sooner" in cadence.reason) == (every_steps > 1896 and cadence is not previous)


def test_a_new_cadence_is_published_when_k_moves_enough() -> None:
    config = CadenceConfig(prior_mtbf_node_h=1000, prior_node_hours=1000, min_interval_s=1, lead_s=10)
    args = {"checkpoint_cost_s": 2.0, "step_time_s": 1.0, "node_hours": 0.0, "nodes": 4, "config": config}
    first = plan_cadence(current_step=0, slowest_step=0, failures=0, **args)  # type: ignore[arg-type]
    after_failures = plan_cadence(current_step=50, slowest_step=49, failures=30, previous=first, **args)  # type: ignore[arg-type]
    assert after_failures.every_steps < first.every_steps  # more failures: save more often
    assert after_failures.from_step == 60  # from a step safely ahead


def policy_of(cadence: Cadence, previous: Cadence | None) -> Policy:
    """The ranks' policy as the controller publishes it: the cadence and the one it replaced."""
    before = PublishedCadence(every_steps=previous.every_steps, from_step=previous.from_step) if previous else None
    return Policy(
        checkpoint=CheckpointCadence(every_steps=cadence.every_steps, from_step=cadence.from_step, previous=before)
    )


def test_a_newer_policy_decides_every_step_a_rank_may_reach_before_it_as_the_one_before() -> None:
    """The controller plans as the checkpoint's cost is measured, K moving by more than 20% each time, a step of
    0.083 s, ranks saving every 20 steps of their own. Each node's file changes at its next heartbeat: until the
    slower one reads it, ranks decide with two versions. They must agree on every step from the slowest rank's to
    the newest's lead: one that saves while its peer does not waits in the save's collective for good."""
    config = CadenceConfig()
    local_every = 20
    previous: Cadence | None = None
    cadence: Cadence | None = None
    published: list[Policy] = []
    for newest, cost_s in ((267, 0.05), (700, 0.2), (750, 0.8), (1200, 3.0), (1250, 12.0)):
        planned = plan_cadence(
            checkpoint_cost_s=cost_s,
            step_time_s=0.083,
            current_step=newest,
            slowest_step=newest - 1,  # ranks in step: the other one a step behind
            failures=0,
            node_hours=0.0,
            nodes=2,
            config=config,
            previous=cadence,
        )
        if planned is cadence:
            continue
        previous, cadence = cadence, planned
        published.append(policy_of(cadence, previous))
        if len(published) < 2:
            continue
        older, newer = published[-2:]
        horizon = newest + math.ceil(config.lead_s / 0.083)
        disagree = [
            s
            for s in range(newest - 1, horizon)
            if older.checkpoint_due(s, s % local_every == 0) != newer.checkpoint_due(s, s % local_every == 0)
        ]
        assert disagree == [], (newest, older, newer)
    assert len(published) >= 2  # the case is one of a cadence replaced


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prior_mtbf_node_h": 0}, "prior_mtbf_node_h"),
        ({"min_interval_s": 10, "max_interval_s": 5}, "min_interval_s"),
        ({"min_lead_steps": 0}, "min_lead_steps"),
        ({"change_ratio": -1}, "change_ratio"),
    ],
    ids=["prior", "bounds", "lead", "change"],
)
def test_config_validates_itself(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CadenceConfig(**kwargs)  # type: ignore[arg-type]
