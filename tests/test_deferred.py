"""The API's event loop never waits for the controller's lock: a heartbeat that finds it held elsewhere is answered
at once, from what its run's last heartbeat was told, and taken in order by the lock's next holder or by the loop a
little later; the liveness datagrams' batches wait their turn (``Controller.drain``, ``opsd.api.liveness``)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import msgspec
import pytest

from opsd.backends.local.processes import free_port
from opsd.controller.controller import Controller
from opsd.controller.state import StateStore
from opsd.protocol.heartbeat import Heartbeat
from opsd.protocol.liveness import Signer, decode_ack, encode_alive, liveness_key
from opsd.protocol.policy_file import Policy
from opsd.protocol.xid_table import XidAction
from tests.serving import start_api
from tests.test_liveness import CREDENTIALS, answer, request
from tests.waiting import wait_for

RUN = "held"


def beat(node: str, step: int, events: list[dict[str, object]] | None = None) -> Heartbeat:
    ranks = [{"run": RUN, "rank": 0, "step": step, "step_s": 0.5, "last_report_unix_s": 0.0}]
    return msgspec.convert(
        {"v": 1, "node": node, "time_unix_s": 0.0, "ranks": ranks, "events": events or []}, Heartbeat
    )


@contextmanager
def held(controller: Controller) -> Iterator[None]:
    """The controller's lock held by another thread (as by a detection pass) until the block ends."""
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with controller.lock:
            taken.set()
            release.wait(30)

    thread = threading.Thread(target=hold)
    thread.start()
    assert taken.wait(10)
    try:
        yield
    finally:
        release.set()
        thread.join(10)


@pytest.fixture
def controller(tmp_path: Path) -> Controller:
    controller = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"))
    controller.heartbeat(beat("node-0", 1), 100.0)  # the node and its run recorded
    with controller.lock:
        controller.remember(RUN).checkpoint_at = 50
    controller.heartbeat(beat("node-0", 2), 101.0)  # told the policy
    return controller


def test_a_heartbeat_finding_the_lock_held_is_answered_at_once_and_taken_in_order_later(
    controller: Controller,
) -> None:
    rank = controller.ranks[RUN][0]
    with held(controller):
        replies = [controller.heartbeat(beat("node-0", step), 100.0 + step, wait=False) for step in (3, 4)]
        assert all(r.policy == Policy(checkpoint_at_step=50) for r in replies)  # as its run's last heartbeat was told
        assert all(r.telemetry_interval_s == controller.telemetry.interval_s for r in replies)
        assert (controller.heartbeats_total, rank.step, len(controller.deferred)) == (2, 2, 2)  # not taken yet
        assert not controller.drain_now()  # still held
    assert controller.drain_now()
    assert (controller.heartbeats_total, rank.step, len(rank.step_times_s), controller.deferred_total) == (4, 4, 3, 2)
    assert controller.nodes["node-0"].posted_s == 104.0


def test_a_detection_pass_takes_what_was_left_before_it_looks(controller: Controller) -> None:
    with held(controller):
        controller.heartbeat(beat("node-0", 3), 103.0, wait=False)
    controller.tick(104.0)
    assert (controller.heartbeats_total, controller.ranks[RUN][0].step, len(controller.deferred)) == (3, 3, 0)


def test_a_heartbeat_of_a_node_with_gpu_events_waits_for_the_lock(controller: Controller) -> None:
    """Its reply acknowledges the events whose incident is recorded: it is not answered from what was told."""
    event = {"seq": 7, "gpu": 0, "xid": 79, "time_s": 101.5, "action": XidAction.CORDON_AND_SWAP.value}
    controller.heartbeat(beat("node-0", 3, [event]), 102.0)
    with ThreadPoolExecutor(1) as pool:
        with held(controller):
            reply = pool.submit(controller.heartbeat, beat("node-0", 4), 103.0, wait=False)
            time.sleep(0.3)
            assert not reply.done()
        assert reply.result(10).ack_events_up_to == 6  # event 7 waits for its incident
    assert not controller.deferred


def test_datagrams_are_not_taken_while_the_lock_is_held(controller: Controller) -> None:
    seq = int(time.time() * 1000)
    with held(controller):
        assert controller.alive_many([("node-0", seq, 105.0)], wait=False) is None
    assert controller.nodes["node-0"].liveness_seq == 0
    assert controller.alive_many([("node-0", seq, 105.0)], wait=False) == 0
    assert controller.nodes["node-0"].liveness_seq == seq


def test_the_api_answers_heartbeats_and_datagrams_while_another_thread_holds_the_lock(tmp_path: Path) -> None:
    """Against the real API: a heartbeat and a datagram are answered while the lock is held, and taken after."""
    controller = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"))
    port = free_port()
    server = start_api(controller, CREDENTIALS, "127.0.0.1", port)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        first = request(port, "POST", "/v1/heartbeat", "agent-token", msgspec.json.encode(beat("node-0", 1)))
        request(port, "POST", "/v1/heartbeat", "agent-token", msgspec.json.encode(beat("node-0", 2)))
        sock.connect(("127.0.0.1", first["liveness_port"]))
        seq = int(time.time() * 1000)
        alive = encode_alive("node-0", seq, Signer(liveness_key("agent-token")))
        with held(controller):
            # answered while the lock is held: the block ends (and releases it) only after the answers
            reply = request(port, "POST", "/v1/heartbeat", "agent-token", msgspec.json.encode(beat("node-0", 3)))
            sock.send(alive)
            assert decode_ack(answer(sock, 10))[0] == seq
            assert reply["telemetry_interval_s"] == first["telemetry_interval_s"]
            time.sleep(0.2)  # the loop tries again meanwhile, and finds the lock still held
            assert controller.heartbeats_total == 2
            assert controller.nodes["node-0"].liveness_seq == 0
        wait_for("the heartbeat and the datagram taken", lambda: controller.nodes["node-0"].liveness_seq == seq, 10)
        wait_for("the heartbeat taken", lambda: controller.heartbeats_total == 3, 10)
        assert controller.ranks[RUN][0].step == 3
        assert "\nopsd_controller_deferred_total 1.0\n" in request(port, "GET", "/metrics", "op-token")
    finally:
        sock.close()
        server.should_exit = True
