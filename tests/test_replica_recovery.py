"""A fault-tolerant run's replica recoveries, driven step by step on the in-memory backend: 2 replica groups of one
node each (rank 0 on node-0 is group 0, rank 1 on node-1 is group 1), a spare node-2, heartbeats and passes at the
times each test gives.

- An XID on group 1's node: node-1 quarantined, the spare promoted, group 1 alone stopped and relaunched; group 0
  never stops; the incident closes when group 1 is back in the quorum, with the steps it missed and the others'
  stall; the goodput counts group 0's steps as productive and only group 1's share of the time as lost.
- No spare: group 1 is stopped and the run trains on with group 0 (running, not waiting); group 1 comes back once a
  node is uncordoned.
- The quorum cannot be kept (the minimum is both groups), or a group found no quorum: the whole job restarts.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from opsd.backends.fake import FakeBackend
from opsd.controller.config import ControllerConfig
from opsd.controller.controller import Controller
from opsd.controller.metrics import ApiStats, ControllerCollector
from opsd.controller.recovery import RECORDED, group_launches
from opsd.controller.rows import GroupLaunch, RunSpec
from opsd.controller.state import StateStore
from opsd.controller.views import postmortem_bundle
from opsd.policy.detection import Failure, FailureKind
from opsd.postmortem.build import build
from opsd.postmortem.render import to_markdown
from opsd.protocol.heartbeat import Heartbeat, HeartbeatFt, HeartbeatRank
from opsd.protocol.policy_file import FailedGroup
from opsd.protocol.states import IncidentState, NodeRole, RunState
from opsd.protocol.steps import Launched
from tests.rows import stored

RUN = "ft"
T0 = 1e10


def ft_run(tmp_path: Path, *, min_replicas: int = 1, spare: bool = True) -> tuple[Controller, FakeBackend]:
    nodes = ["node-0", "node-1", "node-2"] if spare else ["node-0", "node-1"]
    backend = FakeBackend(nodes)
    c = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"), ControllerConfig(), backend, clock=lambda: T0)
    c.recovery.threaded = False
    c.store.create_run(RUN, RunSpec(backend="fake", replica_groups=2, min_replicas=min_replicas), 0.0)
    for node in ("node-0", "node-1"):
        c.store.upsert_node(node, 0.0, run=RUN, role=NodeRole.ACTIVE)
    if spare:
        c.store.upsert_node("node-2", 0.0, run=RUN, role=NodeRole.SPARE)
    c.recovery.launch_first(RUN, 0.0)
    backend.runs[RUN].groups = {0: 0, 1: 1}
    return c, backend


def beat(
    c: Controller,
    now_s: float,
    steps: dict[int, int],
    launches: dict[int, int],
    waited_s: float = 0.0,
    discarded: int = 0,
    **more: Any,
) -> None:
    """Each rank's agent: rank r (group r) at ``steps[r]``, of launch ``launches[r]``, on its node of the fake (a rank
    the fake stopped: on the node it ran on, whose agent still remembers it); ``waited_s`` and ``discarded``: the
    quorum waits and discarded steps its reports summed."""
    backend = c.backend
    assert isinstance(backend, FakeBackend)
    placed = backend.runs[RUN].ranks
    for rank, step in steps.items():
        ft = HeartbeatFt(
            replica_group=rank,
            replica_groups=2,
            quorum_id=1,
            quorum_replicas=len(steps),
            participants=len(steps),
            quorum_wait_total_s=waited_s,
            discarded_steps=discarded,
        )
        r = HeartbeatRank(
            run=RUN, rank=rank, step=step, step_s=0.1, last_report_unix_s=now_s, launch=launches[rank], ft=ft, **more
        )
        node = placed.get(rank, f"node-{rank}")
        c.heartbeat(Heartbeat(v=1, node=node, time_unix_s=now_s, ranks=[r]), now_s)


XID = Failure(FailureKind.FATAL_XID, "node-1", None, "XID 79 on GPU 0")


def fail(c: Controller, failure: Failure = XID) -> int:
    """Both groups at step 40 of their first launch at ``T0``, then ``failure`` at ``T0 + 1``: its incident's id."""
    beat(c, T0, {0: 40, 1: 40}, {0: 1, 1: 1})
    return c.open_failure(stored(c.store.run(RUN)), [failure], T0 + 1)


def test_an_xid_in_one_group_swaps_and_relaunches_that_group_alone(tmp_path: Path) -> None:
    c, backend = ft_run(tmp_path)
    assert stored(c.store.run(RUN)).groups == {0: GroupLaunch(1, ("node-0",)), 1: GroupLaunch(1, ("node-1",))}

    incident = fail(c)

    row = stored(c.store.incident(incident))
    assert (row.replica_group, row.key) == (1, f"{RUN}/gen1/group1")
    run = stored(c.store.run(RUN))
    assert run.state == RunState.RUNNING  # the run never stopped
    assert run.groups[1] == GroupLaunch(2, ("node-2",))
    assert backend.runs[RUN].ranks == {0: "node-0", 1: "node-2"}  # rank 0 was never stopped
    stops = [e for e in backend.effects if e.step == "stop_ranks"]
    assert [e.args.get("group") for e in stops] == [1]
    assert [(a.kind, a.args.get("group")) for a in c.store.actions(incident_id=incident)] == [
        ("cordon", None),
        ("take_spare", None),
        ("stop", 1),
        ("launch", 1),
    ]

    # group 0 trains on, waiting 2.5 s more for its quorum around the failure and discarding the step in flight
    # (its collective failed with group 1's) and the one before group 1 healed; group 1 heals to step 55
    beat(c, T0 + 10, {0: 55}, {0: 1}, waited_s=2.5, discarded=1)
    beat(c, T0 + 12, {0: 56, 1: 55}, {0: 1, 1: 2}, waited_s=2.5, discarded=2)
    c.tick(T0 + 12.5)

    closed = stored(c.store.incident(incident))
    assert closed.state == IncidentState.RECOVERED
    assert (closed.resumed_from_step, closed.lost_steps, closed.missed_steps, closed.stall_s) == (55, 2, 15, 2.5)
    goodput = c.goodput(stored(c.store.run(RUN)), T0 + 100)
    recovery_s = closed.resumed_s - closed.failed_s  # type: ignore[operator]
    assert goodput.quorum_s == 2.5  # the others' stall, at the whole job's share
    lost = goodput.detection_s + goodput.restart_s + goodput.spare_wait_s
    assert lost == pytest.approx(recovery_s / 2)  # group 1's share of the time it was out
    assert goodput.recompute_s == pytest.approx(2 * 0.1 / 2)  # group 0's 2 discarded steps, at its share

    # the post-mortem tells a replica recovery from a restart: no checkpoint read, no step lost, the steps it missed
    bundle = json.loads(msgspec.json.encode(postmortem_bundle(c, RUN, T0 + 100)))
    (report,) = build(bundle, incident).incidents
    assert (report.replica_group, report.missed_steps, report.stall_s, report.lost_steps) == (1, 15, 2.5, 2)
    assert report.resume.reason == "step 55: healed from a live replica group, no checkpoint read"
    md = to_markdown(build(bundle, incident))
    assert "replica group 1 alone: the other groups trained on" in md
    assert "- **steps the group missed**: 15" in md


def test_a_step_the_others_discarded_before_the_group_was_stopped_is_lost_to_its_incident(tmp_path: Path) -> None:
    """Group 1's rank dies; group 0's collective with it fails at once, and group 0 reports the step discarded before
    the controller has even detected the exit: that step is the incident's, though it was heard before the stop."""
    c, _ = ft_run(tmp_path)
    beat(c, T0, {0: 40, 1: 40}, {0: 1, 1: 1})
    beat(c, T0 + 0.5, {0: 40}, {0: 1}, discarded=1)  # the step in flight, thrown away
    exit_ = Failure(FailureKind.PROCESS_EXIT, "node-1", 1, "rank 1 exited with -9", signal=True)

    incident = c.open_failure(stored(c.store.run(RUN)), [exit_], T0 + 1)

    beat(c, T0 + 9, {0: 60, 1: 60}, {0: 1, 1: 2}, discarded=1)  # group 1 back, healed
    c.tick(T0 + 9)
    closed = stored(c.store.incident(incident))
    assert (closed.state, closed.lost_steps) == (IncidentState.RECOVERED, 1)


def test_with_no_spare_the_run_trains_on_without_the_group_until_a_node_is_back(tmp_path: Path) -> None:
    c, backend = ft_run(tmp_path, spare=False)

    incident = fail(c)

    run = stored(c.store.run(RUN))
    assert (run.state, run.groups[1].out) == (RunState.RUNNING, True)  # elastic: not waiting with GPUs idle
    assert backend.runs[RUN].ranks == {0: "node-0"}
    beat(c, T0 + 2, {0: 45, 1: 40}, {0: 1, 1: 1})  # node-1's agent still remembers rank 1: not taken
    assert c.rank_groups(RUN) == {0: 0}
    c.tick(T0 + 2)
    assert stored(c.store.incident(incident)).state == IncidentState.OPEN

    c.set_node_role("node-1", NodeRole.SPARE, "", T0 + 3)  # repaired: back as a spare
    c.tick(T0 + 3)

    run = stored(c.store.run(RUN))
    assert run.groups[1] == GroupLaunch(2, ("node-1",))
    assert backend.runs[RUN].ranks == {0: "node-0", 1: "node-1"}
    beat(c, T0 + 9, {0: 60, 1: 60}, {0: 1, 1: 2})
    c.tick(T0 + 9)
    assert (stored(c.store.incident(incident)).state, stored(c.store.incident(incident)).missed_steps) == (
        IncidentState.RECOVERED,
        20,
    )


def told(c: Controller) -> tuple[FailedGroup, ...] | None:
    """The replica groups the run's policy names as failed now."""
    return c.policies()[RUN].failed_groups


def test_the_other_groups_are_told_a_group_failed_from_its_recovery_until_it_is_back(tmp_path: Path) -> None:
    c, _ = ft_run(tmp_path)
    beat(c, T0, {0: 40, 1: 40}, {0: 1, 1: 1})
    assert told(c) is None  # nothing ever failed: not said
    seen: list[tuple[str, tuple[FailedGroup, ...] | None]] = []
    c.recovery.on_step = lambda point, action: seen.append((action.kind, told(c))) if point == RECORDED else None

    incident = c.open_failure(stored(c.store.run(RUN)), [XID], T0 + 1)

    failed = (FailedGroup(group=1, incident=incident),)
    assert seen == [("cordon", failed), ("take_spare", failed), ("stop", failed), ("launch", failed)]
    assert told(c) == failed  # relaunched, not back yet: its peers may not have heard
    beat(c, T0 + 3, {0: 44, 1: 40}, {0: 1, 1: 1})  # node-1's agent still remembers the old launch's rank
    c.tick(T0 + 3)
    assert told(c) == failed
    beat(c, T0 + 6, {0: 50, 1: 50}, {0: 1, 1: 2})  # healed: in the quorum at the others' step
    c.tick(T0 + 6)
    assert stored(c.store.incident(incident)).state == IncidentState.RECOVERED
    assert told(c) == ()  # withdrawn, and said so (an empty policy would not replace the agents' file)


def test_a_group_out_waiting_for_a_node_is_told_failed_until_it_is_back(tmp_path: Path) -> None:
    c, _ = ft_run(tmp_path, spare=False)

    incident = fail(c)

    assert told(c) == (FailedGroup(group=1, incident=incident),)
    c.set_node_role("node-1", NodeRole.SPARE, "", T0 + 3)
    c.tick(T0 + 3)  # relaunched on it
    assert told(c) == (FailedGroup(group=1, incident=incident),)
    beat(c, T0 + 9, {0: 60, 1: 60}, {0: 1, 1: 2})
    c.tick(T0 + 9)  # back
    assert told(c) == ()


def test_no_group_is_told_failed_when_the_whole_job_restarts_or_nothing_is_done(tmp_path: Path) -> None:
    c, _ = ft_run(tmp_path, min_replicas=2)  # the quorum cannot be kept without group 1: the whole job restarts
    fail(c)
    assert told(c) is None

    dry = tmp_path / "dry"
    dry.mkdir()
    c, _ = ft_run(dry)
    c.config = replace(c.config, dry_run=True)  # detects and records, does nothing: the groups are not told
    fail(c)
    assert told(c) is None


@pytest.mark.parametrize(
    ("min_replicas", "failure"),
    [(2, XID), (1, Failure(FailureKind.NO_QUORUM, "node-0", 0, "rank 0 exited with 75"))],
    ids=["the quorum cannot be kept", "a group found no quorum"],
)
def test_the_whole_job_restarts_when_the_groups_cannot_go_on(
    tmp_path: Path, min_replicas: int, failure: Failure
) -> None:
    c, backend = ft_run(tmp_path, min_replicas=min_replicas)

    incident = fail(c, failure)

    assert stored(c.store.incident(incident)).replica_group is None
    stops = [e for e in backend.effects if e.step == "stop_ranks"]
    assert [e.args.get("group") for e in stops] == [None]  # every rank
    run = stored(c.store.run(RUN))
    assert (run.generation, run.groups[0].launch, run.groups[1].launch) == (2, 2, 2)


@pytest.mark.parametrize(
    ("min_replicas", "counted"),
    [(1, "0 failures"), (2, "1 failures")],
    ids=["a replica recovery restored no checkpoint", "a whole-job restart did"],
)
def test_the_checkpoint_cadence_plans_for_the_failures_that_restore_one(
    tmp_path: Path, min_replicas: int, counted: str
) -> None:
    c, _ = ft_run(tmp_path, min_replicas=min_replicas)
    fail(c)
    launch = 2 if min_replicas == 2 else 1
    for t in (10.0, 11.0):
        beat(c, T0 + t, {0: 50 + int(t)}, {0: launch}, checkpoints=1, checkpoint_blocking_s=2.0)
        c.tick(T0 + t)
    status = c.status(RUN, T0 + 12)
    assert status is not None
    assert status.cadence is not None
    assert f"({counted} in " in status.cadence.reason


def test_the_quorum_and_the_missed_steps_are_exported(tmp_path: Path) -> None:
    """While group 1 is out, the quorum is 1 of 2 groups and one group is out; once it is back, both are in and the
    steps it missed are counted for it."""
    c, _ = ft_run(tmp_path)
    fail(c)
    beat(c, T0 + 5, {0: 50}, {0: 1})

    during = scrape(c, T0 + 5)
    assert (during["opsd_run_replica_groups"], during["opsd_run_replica_groups_out"]) == (2.0, 1.0)
    assert during["opsd_run_quorum_replica_groups"] == 1.0

    beat(c, T0 + 8, {0: 58, 1: 57}, {0: 1, 1: 2})
    c.tick(T0 + 8)
    after = scrape(c, T0 + 8)
    assert (after["opsd_run_quorum_replica_groups"], after["opsd_run_replica_groups_out"]) == (2.0, 0.0)
    assert after['opsd_replica_group_missed_steps_total{group="1"}'] == 17.0


def scrape(c: Controller, now_s: float) -> dict[str, float]:
    """The controller's /metrics of the run, as ``name{other labels}`` -> value (its run label left out)."""
    registry = CollectorRegistry()
    registry.register(ControllerCollector(c, ApiStats(), lambda: now_s))
    out = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.labels.get("run") != RUN:
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "run")
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


@pytest.mark.parametrize(
    ("done", "expected"),
    [
        ({}, {0: GroupLaunch(3, ("a", "b")), 1: GroupLaunch(3, ("c", "d"))}),
        (
            {"launches": [2, 5], "group_nodes": [["d", "a"], ["b", "c"]]},
            {0: GroupLaunch(2, ("d", "a")), 1: GroupLaunch(5, ("b", "c"))},
        ),
        ({"launches": [2, 5]}, {0: GroupLaunch(2, ("a", "b")), 1: GroupLaunch(5, ("c", "d"))}),
        ({"launches": [7]}, {0: GroupLaunch(7, ("a", "b")), 1: GroupLaunch(3, ("c", "d"))}),
    ],
    ids=["one launch for all, the nodes split in order", "each group as the cluster has it", "launches only", "short"],
)
def test_a_whole_launch_gives_each_group_the_launch_and_nodes_the_backend_names(
    done: dict[str, Any], expected: dict[int, GroupLaunch]
) -> None:
    spec = RunSpec(backend="kubernetes", replica_groups=2)
    assert group_launches(spec, 3, ["a", "b", "c", "d"], msgspec.convert(done, Launched)) == expected
