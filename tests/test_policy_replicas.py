"""Which failures of a fault-tolerant run cost one replica group and which the whole job (``opsd.policy.replicas``),
and the replica plan's steps, as tables of named cases."""

from __future__ import annotations

from typing import Any

import pytest

from opsd.policy.detection import DetectionConfig, Failure, FailureKind, RankView, detect_failures
from opsd.policy.recovery import plan_recovery
from opsd.policy.replicas import ReplicaGroups, failed_group, recovery_scope
from opsd.protocol.ft import EXIT_NO_QUORUM
from opsd.protocol.steps import step_args

RANKS = {0: 0, 1: 0, 2: 1, 3: 1}  # rank -> group: 2 groups of 2 ranks
NODES = {"n0": 0, "n1": 1}

SCOPES: dict[str, tuple[FailureKind, str, int | None, ReplicaGroups, list[int], int | None]] = {
    # name: (failure, node, rank, layout, groups in service, the group recovered alone; None: the whole job)
    "a fatal XID on a group's node": (FailureKind.FATAL_XID, "n1", None, ReplicaGroups(2), [0, 1], 1),
    "a lost node": (FailureKind.HEARTBEAT_LOSS, "n0", None, ReplicaGroups(2), [0, 1], 0),
    "a rank that exited, by its rank": (FailureKind.PROCESS_EXIT, "n0", 3, ReplicaGroups(2), [0, 1], 1),
    "a hang blamed on a rank": (FailureKind.HANG, "n1", 2, ReplicaGroups(2), [0, 1], 1),
    "no replica groups": (FailureKind.FATAL_XID, "n1", None, ReplicaGroups(1), [0], None),
    "the quorum could not be kept": (FailureKind.FATAL_XID, "n1", None, ReplicaGroups(2, 2), [0, 1], None),
    "the last group in service": (FailureKind.FATAL_XID, "n1", None, ReplicaGroups(2), [1], None),
    "a group already out fails again": (FailureKind.PROCESS_EXIT, "n0", 3, ReplicaGroups(3, 2), [0, 1, 2], 1),
    "a group found no quorum": (FailureKind.NO_QUORUM, "n0", 1, ReplicaGroups(2), [0, 1], None),
    "an operator's restart": (FailureKind.MANUAL_RESTART, "", None, ReplicaGroups(2), [0, 1], None),
    "a controller that took the run up": (FailureKind.CONTROLLER_RESTART, "", None, ReplicaGroups(2), [0, 1], None),
    "a node of no group": (FailureKind.FATAL_XID, "n9", None, ReplicaGroups(2), [0, 1], None),
}


@pytest.mark.parametrize(("kind", "node", "rank", "layout", "live", "group"), SCOPES.values(), ids=SCOPES.keys())
def test_scope(
    kind: FailureKind, node: str, rank: int | None, layout: ReplicaGroups, live: list[int], group: int | None
) -> None:
    failure = Failure(kind, node, rank, "why")
    scope = recovery_scope(failure, layout, failed_group(failure, RANKS, NODES), live)
    assert scope.group == group, scope.why


def test_a_replica_plan_stops_and_relaunches_its_group_alone() -> None:
    failure = Failure(FailureKind.FATAL_XID, "n1", None, "why")
    plan = plan_recovery(failure, incident_id=4, generation=7, checkpoint_at_step=None, group=1)
    steps: list[tuple[str, dict[str, Any]]] = [(s.kind, step_args(s)) for s in plan]
    assert steps == [
        ("cordon", {"node": "n1", "reason": "why"}),
        ("take_spare", {"for": "n1"}),
        ("stop", {"generation": 7, "group": 1}),
        ("launch", {"after_generation": 7, "group": 1}),
    ]


LAYOUTS = {
    "2 groups of 1 node": (2, 2, [0, 1]),
    "2 groups of 2 nodes": (2, 4, [0, 0, 1, 1]),
    "3 groups of 2 nodes": (3, 6, [0, 0, 1, 1, 2, 2]),
}


@pytest.mark.parametrize(("groups", "nodes", "expected"), LAYOUTS.values(), ids=LAYOUTS.keys())
def test_a_launchs_nodes_split_evenly_in_order(groups: int, nodes: int, expected: list[int]) -> None:
    layout = ReplicaGroups(groups)
    assert [layout.group_of_node(i, nodes) for i in range(nodes)] == expected


def test_nodes_that_do_not_split_are_refused() -> None:
    with pytest.raises(ValueError, match="do not split"):
        ReplicaGroups(2).group_of_node(0, 3)


@pytest.mark.parametrize(("groups", "minimum"), [(0, 1), (2, 0), (2, 3)])
def test_an_impossible_layout_is_refused(groups: int, minimum: int) -> None:
    with pytest.raises(ValueError, match=r"replica_groups|min_replicas"):
        ReplicaGroups(groups, minimum)


CONFIG = DetectionConfig(hang_floor_s=10.0)


def test_a_group_that_stopped_stepping_hangs_alone_while_the_others_train() -> None:
    ranks = [
        RankView(0, "n0", 90, 100.0),
        RankView(1, "n0", 90, 100.0),
        RankView(2, "n1", 40, 50.0),
        RankView(3, "n1", 41, 52.0),
    ]
    failures = detect_failures(now_s=100.0, nodes=[], ranks=ranks, config=CONFIG, rank_groups=RANKS)
    assert [(f.kind, f.rank) for f in failures] == [(FailureKind.HANG, 2)]
    assert "in replica group 1" in failures[0].detail
    assert detect_failures(now_s=100.0, nodes=[], ranks=ranks, config=CONFIG) == []  # the job as one: it steps


def test_a_rank_without_a_quorum_is_no_quorum_in_a_fault_tolerant_run_only() -> None:
    ranks = [RankView(0, "n0", 5, 100.0, exit_code=EXIT_NO_QUORUM)]
    assert [f.kind for f in detect_failures(now_s=100.0, nodes=[], ranks=ranks, config=CONFIG, rank_groups=RANKS)] == [
        FailureKind.NO_QUORUM
    ]
    assert [f.kind for f in detect_failures(now_s=100.0, nodes=[], ranks=ranks, config=CONFIG)] == [
        FailureKind.PROCESS_EXIT
    ]
