"""The goodput simulator's fault-tolerant replica groups (docs/simulation.md, docs/ft.md) against closed forms and
against the checkpoint restart on the same failures."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from opsd.analysis.presets import Workload, presets
from opsd.analysis.replica_groups import ReplicaGroups
from opsd.analysis.simulation import Costs, Policy, Scenario, simulate
from opsd.cli.app import app
from opsd.policy.goodput import BadputBucket

HEAL_S, STALL_S, SIGNAL_S, REBUILD_S, TRANSFER_S = 100.0, 3.0, 1.0, 0.5, 0.25
COSTS = Costs(checkpoint_blocking_s=0.0, checkpoint_background_s=0.0, restart_s=300.0, heal_s=HEAL_S)
COSTS = dataclasses.replace(
    COSTS, quorum_stall_s=STALL_S, signal_s=SIGNAL_S, communicator_rebuild_s=REBUILD_S, heal_transfer_s=TRANSFER_S
)
#: every group's stall when a group is back: its state's transfer, then a new communicator
BACK_S = TRANSFER_S + REBUILD_S


def workload(failures_per_day: float, *causes: tuple[str, float]) -> Workload:
    return Workload("test", 64, 8, failures_per_day, causes or (("dependency", 1.0),), 30, "test")


def test_a_group_that_exits_costs_the_stall_for_all_and_its_relaunch_for_its_share() -> None:
    """A process exit (detected in 2 s): the others wait on the group until opsd's word (2 + 1 s), and for the quorum
    without it (3 s, meanwhile), then for a new communicator (0.5 s); the group's share (1/4) is lost for the rest
    of its 2 + 100 s out; its return stalls every group 0.75 s. Nothing is restored."""
    result = simulate(Scenario(workload(4.0), 400, COSTS), Policy(interval_s=600.0, replica_groups=4, spares=100))
    n = result.failures
    assert n > 1400
    assert result.replica_recoveries == n
    badput = result.badput_s
    stall_s = max(2.0 + SIGNAL_S, STALL_S) + REBUILD_S
    assert badput[BadputBucket.QUORUM] == pytest.approx(n * (stall_s + BACK_S), rel=0.01)
    assert badput[BadputBucket.DETECTION] == pytest.approx(0.0, abs=1.0)
    assert badput[BadputBucket.RESTART] == pytest.approx(n * (2.0 + HEAL_S - stall_s) / 4, rel=0.01)
    assert badput[BadputBucket.RECOMPUTE] == 0.0


@pytest.mark.parametrize(("told", "held_s"), [(True, 5.0 + SIGNAL_S), (False, 60.0)], ids=["told", "untold"])
def test_a_gpu_error_holds_the_others_until_opsd_tells_them_or_their_timeout(told: bool, held_s: float) -> None:
    """An XID (5 s to detect) leaves the group hanging in the others' collective (NCCL): they wait until opsd names it
    failed (its detection and the word's way), or, not told, until their collective's timeout (60 s)."""
    policy = Policy(replica_groups=4, spares=100, survivors_told=told)
    result = simulate(Scenario(workload(4.0, ("GPU", 1.0)), 400, COSTS), policy)
    n = result.failures
    assert result.replica_recoveries == n
    stall_s = held_s + REBUILD_S
    assert result.badput_s[BadputBucket.QUORUM] == pytest.approx(n * (stall_s + BACK_S), rel=0.01)
    assert result.badput_s[BadputBucket.RESTART] == pytest.approx(n * (HEAL_S - stall_s + 5.0) / 4, rel=0.01)


def test_a_network_failure_spans_groups_and_restarts_the_job() -> None:
    """A switch serves nodes of several groups: the whole job falls back to its checkpoint."""
    result = simulate(Scenario(workload(1.0, ("network", 1.0)), 200, COSTS), Policy(replica_groups=8, spares=100))
    assert result.failures > 150
    assert result.replica_recoveries == 0
    assert result.badput_s[BadputBucket.QUORUM] == 0.0


def test_with_no_quorum_left_it_is_the_checkpoint_restart_on_the_same_failures() -> None:
    scenario = Scenario(presets()["opt-175b"], 30, COSTS, replicas=2)
    restart = simulate(scenario, Policy())
    never = simulate(scenario, Policy(replica_groups=4, min_replicas=4))  # no failure can leave 4 groups
    assert never.replica_recoveries == 0
    assert never.badput_s == restart.badput_s
    ft = simulate(scenario, Policy(replica_groups=4))
    assert ft.failures == pytest.approx(restart.failures, rel=0.01)  # the same failures
    assert ft.replica_recoveries > 0.95 * ft.failures
    assert ft.ettr > restart.ettr
    assert ft.badput_s[BadputBucket.RECOMPUTE] < restart.badput_s[BadputBucket.RECOMPUTE] / 10


def test_a_silent_corruption_is_in_every_replica_and_restarts_the_job() -> None:
    result = simulate(Scenario(workload(1.0, ("silent data corruption", 1.0)), 200, COSTS), Policy(replica_groups=8))
    assert result.failures > 150
    assert result.replica_recoveries == 0


def test_two_groups_out_with_a_minimum_of_two_of_three_fall_back_to_the_checkpoint() -> None:
    """3 groups, at least 2 in a quorum: a second failure while a group is still out (spares take a day to come
    back: with none, a group stays out for a repair) restarts the whole job."""
    scenario = Scenario(workload(6.0, ("GPU", 1.0)), 200, dataclasses.replace(COSTS, repair_h=4.0))
    result = simulate(scenario, Policy(replica_groups=3, min_replicas=2, spares=0))
    assert 0 < result.replica_recoveries < result.failures
    assert result.badput_s[BadputBucket.RECOMPUTE] > 0


def test_each_second_of_a_group_out_is_counted_once() -> None:
    """Group A fails at 100 s (stall 3 s, out 102 s), group B at 150 s (stall 10 s, out 105 s), the whole job stops
    at 180 s: A's share is lost over [103, 150) and [160, 180), B's over [160, 180); the stalls count for all."""
    badput = dict.fromkeys(BadputBucket, 0.0)
    groups = ReplicaGroups(4, 1, badput)
    a = groups.fail_one(100.0, 3.0, ((BadputBucket.DETECTION, 2.0), (BadputBucket.RESTART, 100.0)), 1e9)
    b = groups.fail_one(150.0, 10.0, ((BadputBucket.DETECTION, 5.0), (BadputBucket.RESTART, 100.0)), 1e9)
    assert (a, b, groups.live(170.0), groups.can_recover(170.0)) == (103.0, 160.0, 2, True)
    groups.stop_all(180.0)
    assert groups.live(180.0) == 4
    assert badput[BadputBucket.QUORUM] == 13.0
    assert badput[BadputBucket.DETECTION] == 0.0
    assert badput[BadputBucket.RESTART] == pytest.approx((47.0 + 20.0 + 20.0) / 4)
    assert sum(badput.values()) == pytest.approx(13.0 + 87.0 / 4)


def test_a_group_out_rejoins_once_when_it_is_back() -> None:
    badput = dict.fromkeys(BadputBucket, 0.0)
    groups = ReplicaGroups(4, 1, badput)
    assert groups.next_back_s() == float("inf")
    groups.fail_one(100.0, 3.0, ((BadputBucket.RESTART, 50.0),), 1e9)
    groups.fail_one(120.0, 3.0, ((BadputBucket.RESTART, 50.0),), 1e9)
    assert groups.next_back_s() == 150.0
    assert groups.rejoin(149.0) == 0
    assert groups.rejoin(150.0) == 1
    assert groups.rejoin(150.0) == 0  # once
    assert groups.next_back_s() == 170.0


@pytest.mark.parametrize("groups", [2, 3, 8])
def test_the_buckets_never_go_negative_under_overlapping_failures(groups: int) -> None:
    """Failures every 20 minutes against an 8-minute outage, planned stops, no spares at times: groups out overlap
    each other, the whole job's stops and stalls."""
    w = dataclasses.replace(workload(72.0, ("GPU", 1.0), ("dependency", 1.0), ("unknown", 1.0)), planned_per_day=6.0)
    costs = dataclasses.replace(COSTS, heal_s=480.0, quorum_stall_s=30.0, repair_h=1.0)
    result = simulate(Scenario(w, 20, costs), Policy(replica_groups=groups, min_replicas=2 if groups > 2 else 1))
    assert all(v >= -1e-6 for v in result.badput_s.values()), result.badput_s
    assert 0.5 * result.wall_s < result.productive_s < result.wall_s
    assert 0 < result.replica_recoveries < result.failures


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Policy(replica_groups=2, min_replicas=3), "min_replicas <= replica_groups"),
        (lambda: Policy(replica_groups=0), "min_replicas <= replica_groups"),
        (lambda: Costs(heal_s=-1), "heal_s"),
        (lambda: Costs(quorum_stall_s=-1), "quorum_stall_s"),
        (lambda: Costs(communicator_rebuild_s=-1), "communicator_rebuild_s"),
        (lambda: Costs(collective_timeout_s=0), "collective_timeout_s"),
    ],
    ids=["minimum", "groups", "heal", "stall", "rebuild", "timeout"],
)
def test_bad_replica_policies_are_refused(make: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()  # type: ignore[operator]


def test_opsd_simulate_takes_the_replica_groups() -> None:
    args = ["simulate", "--preset", "opt-175b", "--days", "20", "--replicas", "1", "--json"]
    restart = json.loads(CliRunner().invoke(app, args).stdout)
    ft = CliRunner().invoke(app, [*args, "--replica-groups", "4", "--heal-s", "60", "--quorum-stall-s", "2"])
    assert ft.exit_code == 0, ft.output
    body = json.loads(ft.stdout)
    assert body["replica_recoveries"] > 0
    assert body["ettr"] > restart["ettr"]
    assert "4 replica groups (min 1)" in body["policy"]
    untold = CliRunner().invoke(
        app, [*args, "--replica-groups", "4", "--no-survivors-told", "--collective-timeout-s", "90"]
    )
    assert untold.exit_code == 0, untold.output
    assert json.loads(untold.stdout)["ettr"] < body["ettr"]
    assert "4 replica groups (min 1, the others not told)" in json.loads(untold.stdout)["policy"]
    bad = CliRunner().invoke(app, [*args, "--replica-groups", "2", "--min-replicas", "3"])
    assert bad.exit_code == 2
    assert "min_replicas" in bad.output
