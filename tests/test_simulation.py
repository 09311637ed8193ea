"""The goodput simulator against closed forms and published figures (assumptions: docs/simulation.md)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from opsd.analysis.presets import DETECTION, SILENT_DETECTION_S, Detection, Workload, custom_workload, presets
from opsd.analysis.simulation import (
    BUCKETS,
    Costs,
    Policy,
    Scenario,
    log_grid,
    parse_interval,
    simulate,
    sweep,
)
from opsd.analysis.stragglers import Stragglers
from opsd.cli.app import app
from opsd.policy.cadence import CadenceConfig, daly_interval_s
from opsd.policy.goodput import BadputBucket


def workload(failures_per_day: float, category: str = "dependency", gpus: int = 64) -> Workload:
    return Workload("test", gpus, 8, failures_per_day, ((category, 1.0),), 30, "test")


QUIET = Costs(checkpoint_blocking_s=0.0, checkpoint_background_s=0.0, restart_s=300.0)


def test_lost_work_per_failure_is_half_the_interval_plus_the_restore() -> None:
    # MTBF 1 day >> interval 10 min: a failure strikes uniformly within an interval
    result = simulate(Scenario(workload(1.0), 3000, QUIET), Policy(interval_s=600.0))
    assert result.failures > 2500
    assert result.lost_work_per_failure_s == pytest.approx(300.0, rel=0.05)
    downtime = (result.badput_s[BadputBucket.DETECTION] + result.badput_s[BadputBucket.RESTART]) / result.failures
    assert downtime == pytest.approx(2.0 + 300.0, rel=0.01)  # the process-exit detection of opsd, then the restore


def test_the_young_daly_interval_is_within_5_percent_of_the_best_of_a_sweep() -> None:
    # MTBF 2 h, a 60 s blocking checkpoint: the ETTR of a sweep around Daly's interval, same failures throughout;
    # the best interval is the top of a parabola through ETTR against log(interval)
    scenario = Scenario(workload(12.0), 400, Costs(checkpoint_blocking_s=60.0, checkpoint_background_s=0.0))
    daly = daly_interval_s(60.0, 7200.0)
    grid = [daly * f for f in (0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.4, 1.6)]
    ettrs = [r.ettr for r in sweep(scenario, Policy(), grid)]
    a, b, _ = np.polyfit(np.log(grid), ettrs, 2)
    assert a < 0
    assert math.exp(-b / (2 * a)) == pytest.approx(daly, rel=0.05)


NO_DELAY = Detection(xid_s=0.0, node_lost_s=0.0, exit_s=0.0, hang_s=0.0, silent_s=0.0)
INSTANT = Costs(checkpoint_blocking_s=0.0, checkpoint_background_s=0.0, restart_s=0.0)


@pytest.mark.parametrize("rate_x_interval", [0.05, 0.5, 1.0, 2.0])
def test_lost_work_per_failure_is_the_mean_of_an_exponential_cut_at_the_interval(rate_x_interval: float) -> None:
    # MTBF 1 h. After a checkpoint (or a restart) the next failure is exponential (memoryless), and it loses the
    # work since that checkpoint when it comes before the next: E[X | X < tau] = 1/rate - tau / (e^(rate tau) - 1).
    # That is tau/2 only while failures are rare against the interval: a simulator that loses half an interval per
    # crash whatever the rate, or that restarts the failure clock wrongly, misses it at rate x tau = 1 and 2.
    rate = 1 / 3600.0
    tau = rate_x_interval / rate
    result = simulate(Scenario(workload(24.0), 160, INSTANT), Policy(interval_s=tau, detection=NO_DELAY))
    assert result.failures > 3500
    expected = 1 / rate - tau / math.expm1(rate * tau)
    assert result.lost_work_per_failure_s == pytest.approx(expected, rel=0.04)
    if rate_x_interval >= 1:
        assert result.lost_work_per_failure_s < 0.85 * tau / 2


@pytest.mark.parametrize("upload_s", [0.0, 120.0, 400.0])
def test_a_failure_before_the_upload_ends_loses_one_interval_more(upload_s: float) -> None:
    # MTBF 1 day >> tau = 600 s: a failure strikes uniformly within an interval; in the first ``upload_s`` of it the
    # newest checkpoint is not durable yet and the one before is restored: tau/2 + upload_s lost per failure
    costs = Costs(checkpoint_blocking_s=0.0, checkpoint_background_s=upload_s, restart_s=0.0)
    result = simulate(Scenario(workload(1.0), 3000, costs), Policy(interval_s=600.0, detection=NO_DELAY))
    assert result.failures > 2500
    assert result.lost_work_per_failure_s == pytest.approx(300.0 + upload_s, rel=0.05)


def test_the_mtbf_estimate_converges_to_the_rate_of_the_failures_planned_stops_apart() -> None:
    # 8 nodes failing every 2 h (during recoveries too), a planned stop every 2 h that is no failure, and a prior
    # ten times too hopeful (a run MTBF of 20 h): the estimate leaves the prior for the trace's true rate
    w = dataclasses.replace(workload(12.0), planned_per_day=12.0)
    prior = CadenceConfig(prior_mtbf_node_h=160.0, prior_node_hours=100.0)
    costs = Costs(checkpoint_blocking_s=10.0, checkpoint_background_s=0.0, restart_s=600.0)
    errors = []
    for days in (1, 10, 200):
        result = simulate(Scenario(w, days, costs, replicas=4), Policy(interval_s=900.0, cadence=prior))
        errors.append(abs(result.mtbf_estimate_s / 7200.0 - 1))
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 0.03


def test_a_planned_stop_saves_waits_for_the_upload_and_restarts_losing_no_work() -> None:
    w = Workload("test", 64, 8, 0.0, (("dependency", 1.0),), 30, "test", planned_per_day=2.0)
    costs = Costs(checkpoint_blocking_s=5.0, checkpoint_background_s=40.0, restart_s=100.0)
    result = simulate(Scenario(w, 300, costs), Policy(interval_s=1200.0))
    assert result.failures == 0
    assert 500 < result.planned < 700
    assert result.badput_s[BadputBucket.RECOMPUTE] == 0
    # 5 + 40 + 100 s, and now and then the end of the last save's upload first
    assert 145.0 <= result.badput_s[BadputBucket.MAINTENANCE] / result.planned <= 147.0
    assert result.productive_s + sum(result.badput_s.values()) == pytest.approx(result.wall_s)


def test_planned_stops_leave_the_failures_as_they_were() -> None:
    llama3 = presets()["llama3-405b"]
    assert llama3.planned_per_day == pytest.approx(47 / 54)
    none_planned = dataclasses.replace(llama3, planned_per_day=0.0)
    with_planned = simulate(Scenario(llama3, 54, replicas=2), Policy(interval_s=600.0))
    without = simulate(Scenario(none_planned, 54, replicas=2), Policy(interval_s=600.0))
    assert with_planned.failures == without.failures  # the same seeds: the same failures
    assert 2 * 47 * 0.7 < with_planned.planned < 2 * 47 * 1.3
    assert without.planned == 0 == without.badput_s[BadputBucket.MAINTENANCE]
    assert with_planned.badput_s[BadputBucket.MAINTENANCE] > 0


def test_a_silent_data_corruption_is_found_late_by_any_detector() -> None:
    assert dict(presets()["llama3-405b"].causes)["silent data corruption"] == 6  # of 419 (Table 5)
    scenario = Scenario(workload(0.5, category="silent data corruption"), 1000)
    found = {name: simulate(scenario, Policy(interval_s=600.0, detection=name)) for name in DETECTION}
    opsd, watchdog = found["opsd"], found["watchdog"]
    assert opsd.failures > 400
    assert opsd.badput_s == watchdog.badput_s  # nothing in opsd sees it sooner
    per_failure = opsd.badput_s[BadputBucket.DETECTION] / opsd.failures
    assert per_failure == pytest.approx(SILENT_DETECTION_S, rel=0.05)  # less when another failure cuts one short


# opsd simulate's defaults: round figures (docs/simulation.md, "Costs"); bench.goodput uses measured ones
LLAMA3_COSTS = Costs(checkpoint_blocking_s=1.0, checkpoint_background_s=30.0, restart_s=120.0, repair_h=24.0)
# their practice as reconstructed in docs/simulation.md: a synchronous 10 s save every 10 minutes, faults found by a
# 5-minute collective timeout, a 5-minute restart of the whole job
LLAMA3_PRACTICE_COSTS = Costs(checkpoint_blocking_s=10.0, checkpoint_background_s=0.0, restart_s=300.0, repair_h=24.0)


@pytest.mark.parametrize(
    ("costs", "policy", "low", "high"),
    [
        (LLAMA3_COSTS, Policy(), 0.96, 0.975),
        (LLAMA3_PRACTICE_COSTS, Policy(interval_s=600.0, detection="watchdog"), 0.89, 0.92),
    ],
    ids=["opsd", "their-practice"],
)
def test_llama3_ettr_is_inside_its_documented_band(costs: Costs, policy: Policy, low: float, high: float) -> None:
    result = simulate(Scenario(presets()["llama3-405b"], 54, costs, replicas=4), policy)
    assert 419 * 4 * 0.85 < result.failures < 419 * 4 * 1.15
    assert 47 * 4 * 0.7 < result.planned < 47 * 4 * 1.3
    assert low <= result.ettr <= high


def test_wall_time_is_productive_time_plus_every_bucket() -> None:
    result = simulate(
        Scenario(presets()["opt-175b"], 20, stragglers=Stragglers(episodes_per_day=1.0)), Policy(spares=1)
    )
    assert set(result.badput_s) == set(BUCKETS)
    assert all(v >= 0 for v in result.badput_s.values())
    assert result.productive_s + sum(result.badput_s.values()) == pytest.approx(result.wall_s)
    assert result.badput_s[BadputBucket.STRAGGLER] > 0


def test_without_failures_only_checkpoints_cost() -> None:
    result = simulate(Scenario(workload(0.0), 10, Costs(checkpoint_blocking_s=10.0)), Policy(interval_s=990.0))
    assert result.failures == 0
    assert result.ettr == pytest.approx(990 / 1000, abs=1e-4)


def test_a_save_due_during_the_upload_of_the_last_one_waits_for_it() -> None:
    costs = Costs(checkpoint_blocking_s=1.0, checkpoint_background_s=60.0)
    result = simulate(Scenario(workload(0.0), 2, costs), Policy(interval_s=30.0))
    # 30 s of work, then the upload started 30 s ago needs 30 s more, then the 1 s save
    assert result.ettr == pytest.approx(30 / 61, rel=0.01)


def test_the_adaptive_cadence_learns_the_mtbf_from_the_failures() -> None:
    # the prior says a node fails once in 50,000 hours (worth 25 hours of this job); it fails 3,000x as often
    prior = CadenceConfig(prior_mtbf_node_h=50000.0, prior_node_hours=200.0, min_interval_s=1.0)
    w = workload(12.0, gpus=64)  # 8 nodes, MTBF 2 h
    costs = Costs(checkpoint_blocking_s=60.0, checkpoint_background_s=0.0, step_time_s=1.0)
    adaptive = simulate(Scenario(w, 200, costs), Policy(cadence=prior))
    daly = daly_interval_s(60.0, 7200.0)
    prior_only = daly_interval_s(60.0, 50000.0 / 8 * 3600)  # ~52,000 s: what the prior alone would choose
    assert 0.8 * daly < adaptive.mean_interval_s < 1.6 * daly < prior_only / 10
    fixed = simulate(Scenario(w, 200, costs), Policy(interval_s=daly))
    assert adaptive.ettr == pytest.approx(fixed.ettr, abs=0.003)


def test_the_binomial_pool_saves_the_wait_of_a_pool_too_small() -> None:
    scenario = Scenario(presets()["opt-175b"], 60)
    small = simulate(scenario, Policy(spares=0))
    sized = simulate(scenario, Policy())
    assert sized.spares > 0
    assert small.badput_s[BadputBucket.SPARE_WAIT] > 10 * 3600
    assert sized.badput_s[BadputBucket.SPARE_WAIT] < small.badput_s[BadputBucket.SPARE_WAIT] / 20
    assert sized.ettr > small.ettr


def test_swapping_a_straggler_costs_less_than_leaving_it() -> None:
    scenario = Scenario(workload(0.0), 100, stragglers=Stragglers(episodes_per_day=2.0, duration_h=2.0))
    swapped = simulate(scenario, Policy(interval_s=600.0))
    left = simulate(scenario, Policy(interval_s=600.0, swap_stragglers=False))
    assert 0 < swapped.badput_s[BadputBucket.STRAGGLER] < left.badput_s[BadputBucket.STRAGGLER] / 5


def test_watchdog_detection_costs_more_than_opsd_detection() -> None:
    llama3 = presets()["llama3-405b"]
    seen = tuple((c, w) for c, w in llama3.causes if c != "silent data corruption")  # found late by both
    scenario = Scenario(dataclasses.replace(llama3, causes=seen), 20)
    opsd = simulate(scenario, Policy(interval_s=900.0))
    watchdog = simulate(scenario, Policy(interval_s=900.0, detection="watchdog"))
    assert opsd.failures == watchdog.failures  # the same failures: the same seed
    assert watchdog.badput_s[BadputBucket.DETECTION] > 20 * opsd.badput_s[BadputBucket.DETECTION]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("adaptive", None), ("900", 900.0), ("900s", 900.0), ("30m", 1800.0), ("3h", 10800.0), ("steps:100", 500.0)],
    ids=["adaptive", "bare", "seconds", "minutes", "hours", "steps"],
)
def test_parse_interval(text: str, seconds: float | None) -> None:
    assert parse_interval(text, step_time_s=5.0) == seconds


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: parse_interval("soon", 5.0), "expected adaptive"),
        (lambda: parse_interval("-3m", 5.0), "must be > 0"),
        (lambda: Costs(restart_s=-1), "restart_s"),
        (lambda: Policy(detection="psychic"), "policy.detection"),
        (lambda: Policy(spares=-1), "policy.spares"),
        (lambda: Stragglers(slowdown_ratio=0.5), "slowdown_ratio"),
        (lambda: Scenario(workload(1.0), 0), "scenario.days"),
        (lambda: Workload("w", 10, 8, 1, (("GPU", 1),), 1, ""), "multiple"),
        (lambda: custom_workload(8, 8, 1, "GPU", 1), "category=weight"),
        (lambda: custom_workload(8, 8, 1, "cosmic=1", 1), "unknown categories"),
        (lambda: log_grid(10, 5, 3), "grid"),
        (lambda: Detection(xid_s=-1, node_lost_s=0, exit_s=0, hang_s=0), "detection delays"),
        (lambda: DETECTION["opsd"].delay_s("telepathy"), "signal must be one of"),
        (lambda: dataclasses.replace(presets()["llama3-405b"], planned_per_day=-1), "planned_per_day"),
    ],
    ids=[
        "interval",
        "negative",
        "costs",
        "detection",
        "spares",
        "slowdown",
        "days",
        "gpus",
        "mix",
        "category",
        "grid",
        "delays",
        "signal",
        "planned",
    ],
)
def test_bad_input_is_refused_with_a_message(make: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()  # type: ignore[operator]


def test_the_cli_prints_json_and_plots_a_sweep(tmp_path: Path) -> None:
    png = tmp_path / "sweep.png"
    args = ["simulate", "--preset", "llama3-405b", "--days", "10", "--replicas", "1", "--json"]
    result = CliRunner().invoke(app, [*args, "--plot", str(png), "--sweep-points", "5"])
    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    assert body["workload"] == "llama3-405b"
    assert 0.9 < body["ettr"] < 1
    assert body["sweep"]["best_ettr"] >= 0.9
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000


def test_the_cli_prints_a_table_and_refuses_bad_arguments() -> None:
    runner = CliRunner()
    table = runner.invoke(app, ["simulate", "--preset", "bloom-176b", "--interval", "3h", "--spares", "4"])
    assert table.exit_code == 0, table.output
    assert "recompute" in table.output
    assert "ETTR" in table.output
    for bad in (["--interval", "sometimes"], ["--preset", "gpt-5"], ["--spares", "many"], ["--detection", "x"]):
        result = runner.invoke(app, ["simulate", *bad])
        assert result.exit_code == 2, bad
    unwritable = ["simulate", "--days", "2", "--replicas", "1", "--plot", "/nonexistent/dir/x.png"]
    result = runner.invoke(app, unwritable)
    assert result.exit_code == 1
    assert "cannot write the plot" in result.output
