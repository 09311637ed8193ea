"""The controller's side of liveness datagrams and of the telemetry interval, driven with a clock of its own: what
keeps a node alive, what finds it silent, what is refused, and what the heartbeat replies ask for."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from opsd.backends.fake import FakeBackend
from opsd.controller.config import ControllerConfig
from opsd.controller.controller import Controller
from opsd.controller.live import SlotClock
from opsd.controller.state import StateStore
from opsd.policy.detection import DetectionConfig, Failure
from opsd.policy.telemetry import TelemetryConfig
from opsd.protocol.heartbeat import HeartbeatReply
from tests.test_controller import beat, rank

# two nodes at half a heartbeat with ranks a second: they are asked for their ranks every 4 s
CONFIG = ControllerConfig(
    detection=DetectionConfig(heartbeat_floor_s=3, hang_floor_s=60),
    telemetry=TelemetryConfig(heartbeats_per_s=0.5),
    sample_slot_s=1.0,
)
MS = 1000


@pytest.fixture
def controller(tmp_path: Path) -> Controller:
    return Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"), CONFIG)


def post(c: Controller, node: str, t: float, ranks: bool = True, step: int | None = None) -> HeartbeatReply:
    """A heartbeat over HTTP: the node's two ranks at step ``step`` (default ``t`` + 1; or none: liveness only)."""
    first = 0 if node == "n0" else 2
    at = int(t) + 1 if step is None else step
    return c.heartbeat(beat(node, [rank(r, at) for r in (first, first + 1)] if ranks else []), t)


def test_datagrams_keep_nodes_alive_between_heartbeats_and_a_silent_one_is_found(controller: Controller) -> None:
    """Ranks every 4 s (as the replies ask), a datagram a second: no node is lost; n1 dies at 20 s (n0's ranks, its
    peers, stop at their step of then) and is found lost after its last datagram, not after 5 x 4 s: once a step of
    n0's ranks proving n1's alive would have been seen, 1 (a beat) + 0.6 (a step) + 4 (a report) + 1 (the margin)
    + 4 (the next report) = 10.6 s after it."""
    replies = [post(controller, n, 0.0) for n in ("n0", "n1")]
    assert [r.telemetry_interval_s for r in replies] == [2.0, 4.0]  # planned again as the second node came
    t, found = 0.0, list[Failure]()
    while t < 40 and not found:
        t = round(t + 0.5, 1)
        for node in ("n0", "n1"):
            if node == "n1" and t >= 20:
                continue
            if t == int(t):
                assert controller.alive(node, int(t * MS), t) is None
            if t % 4 == 0:
                post(controller, node, t, step=17 if t >= 20 else None)  # n0's ranks stopped at 17 with n1
        found = controller.tick(t)
    assert (found[0].kind.value, found[0].node) == ("heartbeat_loss", "n1")
    assert t == 30.0  # its last datagram at 19 s: the first pass more than 10.6 s later
    (incident,) = controller.store.incidents("job")
    assert (incident.failed_s, incident.detected_s) == (19.0, 30.0)


def test_a_node_heard_only_through_its_datagrams_says_nothing_of_its_ranks(tmp_path: Path) -> None:
    """``opsd run``'s floors (heartbeat 3 s, hang 6 s). n1's agent is paused from 10 s to 25 s (as during its
    restart) while every rank trains on, and n0's heartbeats with the ranks fail from 12 s to 22 s (a timeout, then
    its backoff) while its datagrams come every second. No step reaches the controller in between, but none was seen
    missing either: the run is not judged hung (before, the steps last carried at 12 s made a 7 s hang at 19 s), and
    n1 is not lost (its peers' steps are not seen; the backend says its ranks run): its agent was down, a warning."""
    config = replace(CONFIG, detection=DetectionConfig(heartbeat_floor_s=3, hang_floor_s=6))
    controller = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"), config, FakeBackend(["n0", "n1"]))
    found: list[Failure] = []
    for tenths in range(0, 300, 5):
        t = tenths / 10
        for node in ("n0", "n1"):
            if node == "n1" and 10 <= t < 25:
                continue  # paused
            if t % 2 == 0 and not (node == "n0" and 12 <= t < 22):
                post(controller, node, t)
            if t == int(t):
                assert controller.alive(node, int(t * MS) + 1, t) is None
        found += controller.tick(t)
    assert found == []
    assert [(i.kind, i.node, i.state) for i in controller.store.incidents("job")] == [("agent_down", "n1", "warned")]


def test_replays_and_clocks_too_far_off_are_refused(controller: Controller) -> None:
    assert controller.alive("n0", 10 * MS, 10.0) is None
    assert controller.alive("n0", 10 * MS, 10.5) == "replay"  # the same datagram again
    assert controller.alive("n0", 9 * MS, 11.0) == "replay"  # an older one
    assert controller.alive("n0", 11 * MS, 11.0) is None
    assert controller.alive("n0", 100 * MS, 12.0) == "skew"  # its clock 88 s ahead
    assert controller.alive("n1", 1 * MS, 60.0) == "skew"  # a datagram captured a minute ago
    assert controller.datagrams_total == 2
    assert controller.nodes["n0"].last_heartbeat_s == 11.0


def test_a_nodes_intervals_are_those_of_the_channel_that_carries_its_liveness(controller: Controller) -> None:
    post(controller, "n0", 0.0)
    for t in range(1, 9):  # datagrams a second, the ranks at 4 s and 8 s, each half a second after a datagram
        controller.alive("n0", t * MS, float(t))
        if t % 4 == 0:
            post(controller, "n0", t + 0.5)
    assert list(controller.nodes["n0"].intervals_s) == [1.0] * 7  # the heartbeats are no intervals
    for at_s in (10.5, 11.5, 12.5):  # no datagram gets through: liveness over HTTP, a second apart
        post(controller, "n0", at_s, ranks=False)
    assert list(controller.nodes["n0"].intervals_s)[7:] == [2.0, 1.0, 1.0]  # from its last heartbeat, at 8.5 s
    post(controller, "n1", 0.0)
    post(controller, "n1", 1.0)  # an agent that sends no datagrams: its heartbeats, as before
    post(controller, "n1", 2.0)
    assert list(controller.nodes["n1"].intervals_s) == [1.0, 1.0]


def test_the_replies_name_the_port_and_the_interval_which_sets_the_slots(tmp_path: Path) -> None:
    config = ControllerConfig(telemetry=TelemetryConfig(heartbeats_per_s=1500), sample_slot_s=2.0)
    c = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"), config)
    reply = c.heartbeat(beat("n0", []), 100.0)
    assert (reply.telemetry_interval_s, reply.liveness_port) == (1.0, None)  # datagrams not taken: no port
    c.liveness_port = 8470
    for i in range(12287):  # a job of 12,288 nodes says it is alive
        c.alive(f"node-{i:05d}", 100_000 + i, 100.0)
    slot_before = c.slots.index(101.0)
    reply = c.heartbeat(beat("n0", []), 101.0)
    assert (reply.telemetry_interval_s, reply.liveness_port) == (9.0, 8470)
    assert (c.telemetry.sample_slot_s, c.slots.length_s) == (9.0, 9.0)
    assert c.slots.index(101.0) == slot_before  # the current slot ends as it began
    assert c.slots.index(102.0) == slot_before + 1  # then 9 s slots
    assert c.slots.index(110.9) == slot_before + 1
    assert c.liveness_channels(101.0) == {"datagram": 12287, "http": 1}


def test_a_large_jobs_first_heartbeat_asks_for_the_interval_of_its_size(tmp_path: Path) -> None:
    """A node of a 12,288-node job (98,304 ranks, 8 a node) is the first heard from: its reply asks for the ranks
    every 9 s at once, as it would once every node was heard; a job that does not say its size, every second."""
    config = ControllerConfig(telemetry=TelemetryConfig(heartbeats_per_s=1500), sample_slot_s=2.0)
    c = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"), config)
    assert c.heartbeat(beat("n0", [rank(r, 1, world_size=98_304) for r in range(8)]), 100.0).telemetry_interval_s == 9
    assert "12288 nodes by the jobs' world size (1 heard)" in c.telemetry.reason
    assert (
        c.heartbeat(beat("n1", [rank(r, 1, world_size=98_304) for r in range(8, 16)]), 101.0).telemetry_interval_s == 9
    )
    small = Controller(StateStore.open(f"sqlite:///{tmp_path / 'small.db'}"), config)
    assert small.heartbeat(beat("n0", [rank(r, 1) for r in range(8)]), 100.0).telemetry_interval_s == 1


def test_a_graceful_restart_leads_by_at_least_three_intervals(tmp_path: Path) -> None:
    config = ControllerConfig(telemetry=TelemetryConfig(heartbeats_per_s=1))  # a node: every second; 4: every 4 s
    c = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"), config)
    for t in range(4):
        post(c, "n0", float(t))
    assert c.checkpoint_step_ahead("job") == 4 + 9  # restart_lead_s: 5 s of 0.6 s steps
    for node in ("n1", "n2", "n3"):
        c.heartbeat(beat(node, []), 4.0)
    assert c.telemetry.interval_s == 4.0
    assert c.checkpoint_step_ahead("job") == 4 + 20  # 3 x 4 s of 0.6 s steps


#: resize at (time, new length) -> the slot numbers at times
SLOTS = {
    "unchanged: now // length": ([], {0.0: 0, 1.9: 0, 2.0: 1, 101.0: 50}),
    "longer from the end of the current slot": (
        [(101.0, 9.0)],
        {101.0: 50, 101.99: 50, 102.0: 51, 110.9: 51, 111.0: 52},
    ),
    "shorter from the end of the current slot": ([(10.0, 9.0), (20.0, 1.0)], {20.0: 6, 20.9: 6, 21.0: 7, 28.0: 14}),
    "twice within one slot: the last length wins": ([(3.0, 9.0), (3.5, 4.0)], {3.9: 1, 4.0: 2, 8.0: 3}),
    "a clock gone back: the slot before": ([(101.0, 9.0)], {50.0: 50}),
}


@pytest.mark.parametrize(("resizes", "expected"), list(SLOTS.values()), ids=list(SLOTS))
def test_slot_numbers_never_go_back(resizes: list[tuple[float, float]], expected: dict[float, int]) -> None:
    clock = SlotClock(2.0)
    for at_s, length_s in resizes:
        clock.resize(length_s, at_s)
    assert {t: clock.index(t) for t in expected} == expected
