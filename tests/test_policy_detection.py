"""Failure detection, as tables of named cases (time is an argument)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from opsd.policy.detection import (
    CollectiveTimeout,
    DetectionConfig,
    FailureKind,
    GpuEvent,
    NodeView,
    RankView,
    detect,
    detect_failures,
    hang_timeout_s,
    heartbeat_timeout_s,
    witness_grace_s,
)
from opsd.protocol.xid_table import XidAction

C = DetectionConfig(heartbeat_factor=5, heartbeat_floor_s=3, hang_factor=3, hang_floor_s=10)


@pytest.mark.parametrize(
    ("intervals", "timeout"),
    [((), 3.0), ((1.0, 1.0, 1.2), 5.0), ((0.1, 0.1), 3.0), ((30.0, 30.0), 150.0)],
    ids=["no history: floor", "1 s beats", "fast beats: floor", "slow beats"],
)
def test_heartbeat_timeout_follows_the_observed_interval(intervals: tuple[float, ...], timeout: float) -> None:
    assert heartbeat_timeout_s(intervals, C) == timeout


@pytest.mark.parametrize(
    ("steps", "timeout"),
    [((), 10.0), ((0.5, 0.6, 0.5), 10.0), ((2400.0,), 7200.0)],
    ids=["no history", "fast steps: floor", "40-minute steps"],
)
def test_hang_timeout_follows_the_step_time(steps: tuple[float, ...], timeout: float) -> None:
    assert hang_timeout_s(steps, C) == timeout


def node(name: str, last: float) -> NodeView:
    return NodeView(name, last, (1.0, 1.0, 1.0))


def rank(r: int, n: str, step: int, progress: float, exit_code: int | None = None, seen: float = math.inf) -> RankView:
    return RankView(r, n, step, progress, exit_code, seen)


HEALTHY_NODES = [node("n0", 99.5), node("n1", 99.8)]
HEALTHY_RANKS = [rank(0, "n0", 50, 99.0), rank(1, "n0", 50, 99.0), rank(2, "n1", 50, 99.1), rank(3, "n1", 50, 99.1)]
# n1 went silent at 94 s: its ranks' last steps were seen by then, and n0's ranks stopped within a step of it
STALLED_RANKS = [rank(0, "n0", 40, 94.6), rank(1, "n0", 40, 94.6), rank(2, "n1", 39, 93.9), rank(3, "n1", 39, 93.9)]

CASES: dict[str, tuple[dict[str, object], list[tuple[FailureKind, str, int | None]]]] = {
    "healthy": ({}, []),
    "silent node, its ranks' peers stopped with it": (
        {"nodes": [node("n0", 99.5), node("n1", 94.0)], "ranks": STALLED_RANKS},
        [(FailureKind.HEARTBEAT_LOSS, "n1", None)],
    ),
    "late but within 5x interval": ({"nodes": [node("n0", 99.5), node("n1", 95.5)]}, []),
    "fatal XID": (
        {"events": [GpuEvent("n1", 1, 79, XidAction.CORDON_AND_SWAP, "fallen off the bus")]},
        [(FailureKind.FATAL_XID, "n1", None)],
    ),
    "application XID": (
        {"events": [GpuEvent("n0", 0, 13, XidAction.RESTART_JOB)]},
        [(FailureKind.APPLICATION_XID, "n0", None)],
    ),
    "rank exited": (
        {"ranks": [*HEALTHY_RANKS[:3], rank(3, "n1", 50, 99.1, exit_code=-9)]},
        [(FailureKind.PROCESS_EXIT, "n1", 3)],
    ),
    "a rank killed by a signal is the cause, before its peer that exited with an error": (
        {
            "ranks": [
                rank(0, "n0", 50, 99.0, exit_code=1),
                rank(1, "n0", 50, 99.0),
                rank(2, "n1", 50, 99.1, exit_code=-9),
            ]
        },
        [(FailureKind.PROCESS_EXIT, "n1", 2), (FailureKind.PROCESS_EXIT, "n0", 0)],
    ),
    "clean exit is no failure": ({"ranks": [rank(0, "n0", 60, 99.0, exit_code=0)]}, []),
    "hang: nobody advanced for 3 x 0.5 s... but the floor is 10 s": (
        {"ranks": [rank(r, "n0", 50, 91.0) for r in range(2)]},
        [],
    ),
    "hang past the floor, the rank behind named": (
        {"ranks": [rank(0, "n0", 50, 85.0), rank(1, "n0", 49, 84.0), rank(2, "n1", 50, 85.0)]},
        [(FailureKind.HANG, "n0", 1)],
    ),
    # heartbeats carry the ranks every 1 s (``report_interval_s``) and the floor is 3 s: a rank no heartbeat carried
    # since 96 s is not judged; a heartbeat without ranks, or a liveness datagram, keeps its node heard
    "no hang judged on steps no heartbeat carried: n0's heartbeats with ranks back off, its datagrams come": (
        {"ranks": [rank(r, "n0", 50, 85.0, seen=85.5) for r in range(2)]},
        [],
    ),
    "hang: heartbeats carried the ranks within the window, and no step since": (
        {"ranks": [rank(r, "n0", 50, 85.0, seen=99.0) for r in range(2)]},
        [(FailureKind.HANG, "n0", 0)],
    ),
    "the stall runs to the oldest heartbeat that carried the ranks (9.5 s), not to now (13 s)": (
        {"ranks": [rank(0, "n0", 50, 87.0, seen=99.0), rank(1, "n1", 50, 87.0, seen=96.5)]},
        [],
    ),
    "a rank no heartbeat carried lately is not judged: the furthest behind is named among those seen": (
        {"ranks": [rank(0, "n0", 40, 80.0, seen=90.0), rank(1, "n0", 49, 84.0), rank(2, "n1", 50, 85.0)]},
        [(FailureKind.HANG, "n0", 1)],
    ),
    # a rank that says what it does instead of stepping holds its peers in their next collective: not hung, for up
    # to busy_limit_s (1,800 s)
    "a rank that says it waits for a checkpoint: no hang": (
        {
            "ranks": [
                replace(rank(0, "n0", 50, 85.0), activity="checkpoint", activity_since_s=85.5),
                rank(1, "n1", 50, 85.0),
            ]
        },
        [],
    ),
    "ranks that say they end: no hang": (
        {"ranks": [replace(rank(r, "n0", 50, 85.0), activity="closing", activity_since_s=86.0) for r in range(2)]},
        [],
    ),
    "a checkpoint said longer ago than the limit: a hang": (
        {
            "ranks": [
                replace(rank(0, "n0", 50, 85.0), activity="checkpoint", activity_since_s=-1800.5),
                rank(1, "n1", 49, 84.0),
            ]
        },
        [(FailureKind.HANG, "n1", 1)],
    ),
    "collective timeout: the rank that does not wait is the suspect": (
        {
            "ranks": [*HEALTHY_RANKS[:2], rank(2, "n1", 49, 98.0), HEALTHY_RANKS[3]],
            "timeouts": [CollectiveTimeout(r, "n0" if r < 2 else "n1", f"rank {r} waited") for r in (0, 1, 3)],
        },
        [(FailureKind.COLLECTIVE_TIMEOUT, "n1", 2)],
    ),
    "collective timeout: of those not waiting, the one furthest behind": (
        {
            "ranks": [rank(0, "n0", 50, 99.0), rank(1, "n0", 48, 97.0), rank(2, "n1", 50, 99.1)],
            "timeouts": [CollectiveTimeout(0, "n0", "rank 0 waited 300 s in all_reduce on tp")],
        },
        [(FailureKind.COLLECTIVE_TIMEOUT, "n0", 1)],
    ),
    "collective timeout: every rank waits, the first reporter named": (
        {"timeouts": [CollectiveTimeout(r, "n0" if r < 2 else "n1", "waited") for r in (3, 0, 1, 2)]},
        [(FailureKind.COLLECTIVE_TIMEOUT, "n1", 3)],
    ),
    # a fault-tolerant run (C: hang floor 10 s, peer_wait_s 120 s): group 0 stalled 15 s, group 1 gone from the launch
    "replica groups: a group stalled past the floor hangs on its own": (
        {"ranks": [rank(0, "n0", 50, 85.0), rank(1, "n0", 50, 85.0)], "rank_groups": {0: 0, 1: 0}},
        [(FailureKind.HANG, "n0", 0)],
    ),
    "replica groups: not while another group is being recovered (it may wait on it to its timeout)": (
        {"ranks": [rank(0, "n0", 50, 85.0), rank(1, "n0", 50, 85.0)], "rank_groups": {0: 0, 1: 0}, "recovering": [1]},
        [],
    ),
    "replica groups: a group stalled past the floor and the peer wait hangs, another being recovered or not": (
        {"ranks": [rank(0, "n0", 50, -35.5), rank(1, "n0", 50, -35.5)], "rank_groups": {0: 0, 1: 0}, "recovering": [1]},
        [(FailureKind.HANG, "n0", 0)],
    ),
    "replica groups: the group being recovered is no reason to wait on itself": (
        {"ranks": [rank(0, "n0", 50, 85.0), rank(1, "n0", 50, 85.0)], "rank_groups": {0: 0, 1: 0}, "recovering": [0]},
        [(FailureKind.HANG, "n0", 0)],
    ),
    "swaps come first": (
        {
            "nodes": [node("n0", 99.5), node("n1", 94.0)],
            "ranks": [*STALLED_RANKS[:3], rank(3, "n1", 50, 93.9, exit_code=1)],
        },
        [(FailureKind.HEARTBEAT_LOSS, "n1", None), (FailureKind.PROCESS_EXIT, "n1", 3)],
    ),
}


@pytest.mark.parametrize(("changes", "expected"), CASES.values(), ids=CASES.keys())
def test_detect_failures(changes: dict[str, object], expected: list[tuple[FailureKind, str, int | None]]) -> None:
    inputs: dict[str, object] = {"nodes": HEALTHY_NODES, "ranks": HEALTHY_RANKS, "step_times_s": [0.5] * 10}
    inputs.update(changes)
    found = detect_failures(now_s=100.0, config=C, **inputs)  # type: ignore[arg-type]
    assert [(f.kind, f.node, f.rank) for f in found] == expected
    assert all(f.detail for f in found)
    assert [f.swap for f in found] == [k in (FailureKind.HEARTBEAT_LOSS, FailureKind.FATAL_XID) for k, _, _ in expected]


LIVE_PEERS = [rank(0, "n0", 60, 99.0), rank(1, "n0", 60, 99.0), rank(2, "n1", 48, 93.9), rank(3, "n1", 48, 93.9)]


def silence(**changes: object) -> dict[str, object]:
    """n1 silent since 94 s (its beats every 1 s), steps of 0.5 s, ranks reported every 1 s: a peer's step seen
    after 94 + 1 + 0.5 + 1 + 1 (margin) = 97.5 s proves n1's ranks alive; with none seen by 98.5 s, n1 is lost."""
    inputs: dict[str, object] = {
        "nodes": [node("n0", 99.5), node("n1", 94.0)],
        "ranks": LIVE_PEERS,
        "step_times_s": [0.5] * 10,
        "report_interval_s": 1.0,
    }
    inputs.update(changes)
    return inputs


SILENCES: dict[str, tuple[dict[str, object], list[tuple[FailureKind, str]], list[str]]] = {
    "peers step on: the agent is down, not the node": (silence(), [], ["n1"]),
    "peers stopped within a step of the silence: lost": (
        silence(ranks=STALLED_RANKS),
        [(FailureKind.HEARTBEAT_LOSS, "n1")],
        [],
    ),
    "a peer's last step seen just before the proof time proves nothing": (
        silence(ranks=[rank(0, "n0", 41, 97.4), *STALLED_RANKS[1:]]),
        [(FailureKind.HEARTBEAT_LOSS, "n1")],
        [],
    ),
    "no proof yet, but one may still be on its way: no verdict": (
        silence(ranks=STALLED_RANKS, now_s=98.4, nodes=[node("n0", 98.0), node("n1", 93.0)], report_interval_s=2.0),
        [],
        [],
    ),
    "ranks reported every 9 s: a peer's proof comes later, and the verdict waits for it": (
        silence(ranks=STALLED_RANKS, report_interval_s=9.0),
        [],
        [],
    ),
    "the peers' node is silent too: no peer witness, lost as before": (
        silence(nodes=[node("n0", 94.0), node("n1", 94.0)]),
        [(FailureKind.HEARTBEAT_LOSS, "n0"), (FailureKind.HEARTBEAT_LOSS, "n1")],
        [],
    ),
    "the peers' steps stopped with n1 as far as heartbeats carried them, none since 95 s: the backend decides": (
        silence(ranks=[replace(r, seen_s=95.0) for r in STALLED_RANKS], node_ready={"n1": True}),
        [],
        ["n1"],
    ),
    "the same peers carried by a heartbeat at 99 s: they stopped with it, lost": (
        silence(ranks=[replace(r, seen_s=99.0) for r in STALLED_RANKS], node_ready={"n1": True}),
        [(FailureKind.HEARTBEAT_LOSS, "n1")],
        [],
    ),
    "the peers say they wait for a checkpoint: they witness nothing, the backend decides": (
        silence(
            ranks=[replace(r, activity="checkpoint", activity_since_s=94.5) for r in STALLED_RANKS],
            node_ready={"n1": True},
        ),
        [],
        ["n1"],
    ),
    "a single-node run: the backend says its ranks run": (
        silence(ranks=[rank(2, "n1", 48, 93.9), rank(3, "n1", 48, 93.9)], node_ready={"n1": True}),
        [],
        ["n1"],
    ),
    "a single-node run: the backend says the node is down": (
        silence(ranks=[rank(2, "n1", 48, 93.9), rank(3, "n1", 48, 93.9)], node_ready={"n1": False}),
        [(FailureKind.HEARTBEAT_LOSS, "n1")],
        [],
    ),
    "a single-node run silent past the hang floor: its ranks are not judged hung by their agent's silence": (
        silence(
            nodes=[node("n1", 84.0)], ranks=[rank(2, "n1", 48, 83.9), rank(3, "n1", 48, 83.9)], node_ready={"n1": True}
        ),
        [],
        ["n1"],
    ),
    "a single-node run and no backend witness: lost as before": (
        silence(ranks=[rank(2, "n1", 48, 93.9), rank(3, "n1", 48, 93.9)]),
        [(FailureKind.HEARTBEAT_LOSS, "n1")],
        [],
    ),
    "a node with no rank of the run: lost as before": (
        silence(ranks=HEALTHY_RANKS[:2]),
        [(FailureKind.HEARTBEAT_LOSS, "n1")],
        [],
    ),
    "replica groups: the other group stepping proves nothing about n1's group": (
        silence(rank_groups={0: 0, 1: 0, 2: 1, 3: 1}),
        [(FailureKind.HEARTBEAT_LOSS, "n1")],
        [],
    ),
    "replica groups: n1's group's peers on n2 step on": (
        silence(
            nodes=[node("n0", 99.5), node("n1", 94.0), node("n2", 99.5)],
            ranks=[*LIVE_PEERS, rank(4, "n2", 60, 99.2), rank(5, "n2", 60, 99.2)],
            rank_groups={0: 0, 1: 0, 2: 1, 3: 1, 4: 1, 5: 1},
        ),
        [],
        ["n1"],
    ),
}


@pytest.mark.parametrize(("inputs", "failures", "down"), SILENCES.values(), ids=SILENCES.keys())
def test_a_silent_agent_is_a_lost_node_only_when_a_second_witness_agrees(
    inputs: dict[str, object], failures: list[tuple[FailureKind, str]], down: list[str]
) -> None:
    now_s = float(inputs.pop("now_s", 100.0))  # type: ignore[arg-type]
    found = detect(now_s=now_s, config=C, **inputs)  # type: ignore[arg-type]
    assert [(f.kind, f.node) for f in found.failures] == failures
    assert [d.node for d in found.agents_down] == down
    assert all(d.detail for d in found.agents_down)
    for f in found.failures:
        assert "witness" in f.detail or "stopped" in f.detail or "down" in f.detail or "no rank" in f.detail


def test_the_grace_counts_a_beat_a_step_a_report_and_the_margin() -> None:
    assert witness_grace_s((1.0, 1.0, 3.0), (0.5, 0.7, 0.5), 4.0, C) == pytest.approx(1.0 + 0.5 + 4.0 + 1.0)
    assert witness_grace_s((), (), 1.0, C) == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"heartbeat_factor": 0.5}, "factor"), ({"hang_floor_s": 0}, "floor"), ({"witness_margin_s": -1}, "margin")],
    ids=["factor", "floor", "margin"],
)
def test_config_validates_itself(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DetectionConfig(**kwargs)


def test_a_hang_past_the_busy_limit_says_what_the_rank_had_said() -> None:
    ranks = [replace(rank(0, "n0", 50, 85.0), activity="checkpoint", activity_since_s=50.0), rank(1, "n1", 50, 85.0)]
    config = DetectionConfig(heartbeat_floor_s=3, hang_floor_s=10, busy_limit_s=30)
    (hang,) = detect_failures(now_s=100.0, nodes=HEALTHY_NODES, ranks=ranks, config=config)
    assert hang.kind is FailureKind.HANG
    assert "rank 0 said 'checkpoint' 50 s ago (> 30 s)" in hang.detail
