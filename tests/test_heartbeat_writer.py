"""What a job of many nodes starting costs the controller: its nodes' first heartbeats written in one transaction
(``StateStore.activate_nodes``, ``Controller.register``, the API's ``HeartbeatWriter``), and the nodes whose first
heartbeat waits for the writer counted at once in the interval the replies ask for."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest
from sqlalchemy import event

from opsd.api.writer import HeartbeatWriter
from opsd.backends.local.processes import free_port
from opsd.controller.config import ControllerConfig
from opsd.controller.controller import Controller
from opsd.controller.state import StateStore
from opsd.policy.telemetry import TelemetryConfig
from opsd.protocol.heartbeat import Heartbeat, HeartbeatReply
from opsd.protocol.states import NodeRole
from tests.serving import start_api
from tests.test_liveness import CREDENTIALS, request
from tests.waiting import wait_for

RUN = "big"


def first_beat(node: str, rank: int) -> Heartbeat:
    ranks = [{"run": RUN, "rank": rank, "step": 1, "step_s": 0.1, "last_report_unix_s": 0.0}]
    return msgspec.convert({"v": 1, "node": node, "time_unix_s": 0.0, "ranks": ranks}, Heartbeat)


def commits(store: StateStore) -> list[int]:
    """A list that counts the store's commits from now on."""
    counted: list[int] = []
    event.listen(store.engine, "commit", lambda _: counted.append(1))
    return counted


def test_nodes_become_active_members_of_their_run_in_one_transaction(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'opsd.db'}"
    store = StateStore.open(url)
    store.upsert_node("spare-0", 1.0)  # a spare with no run yet
    counted = commits(store)
    store.activate_nodes({"node-0": RUN, "node-1": RUN, "spare-0": RUN}, 2.0)
    assert len(counted) == 1
    for reopened in (store, StateStore.open(url)):  # in memory and in the database alike
        rows = {n.name: (n.run, n.role, n.updated_s) for n in reopened.nodes()}
        assert rows == {n: (RUN, NodeRole.ACTIVE, 2.0) for n in ("node-0", "node-1", "spare-0")}


def test_a_batch_of_first_heartbeats_is_registered_at_once(tmp_path: Path) -> None:
    controller = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"))
    beats = [first_beat(f"node-{i}", i) for i in range(50)]
    assert all(controller.heartbeat_writes(b) for b in beats)
    counted = commits(controller.store)
    controller.register(beats, 5.0)
    assert len(counted) == 2  # the run, then the 50 nodes
    assert not any(controller.heartbeat_writes(b) for b in beats)  # each now taken in memory alone
    assert controller.store.node_names(RUN, NodeRole.ACTIVE) == {f"node-{i}" for i in range(50)}
    assert controller.store.run(RUN) is not None


def test_the_writer_answers_every_heartbeat_that_queued_up(tmp_path: Path) -> None:
    controller = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"))
    writer = HeartbeatWriter(controller, lambda: 5.0)
    counted = commits(controller.store)

    async def many() -> list[float | None]:
        replies = await asyncio.gather(*(writer.take(first_beat(f"node-{i}", i)) for i in range(300)))
        return [r.telemetry_interval_s for r in replies]

    assert len(asyncio.run(many())) == 300
    assert len(controller.store.node_names(RUN, NodeRole.ACTIVE)) == 300
    assert len(counted) < 300  # batches, not a commit per node


def test_a_closed_writer_has_taken_what_queued_up_and_its_thread_has_ended(tmp_path: Path) -> None:
    controller = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"))
    writer = HeartbeatWriter(controller, lambda: 5.0)

    async def some_then_close() -> int:
        pending = [asyncio.ensure_future(writer.take(first_beat(f"node-{i}", i))) for i in range(100)]
        await asyncio.sleep(0)  # every one queued
        thread = writer._thread
        await asyncio.get_running_loop().run_in_executor(None, writer.close)
        assert thread is not None
        assert not thread.is_alive()
        return len(await asyncio.gather(*pending))

    assert asyncio.run(some_then_close()) == 100
    assert len(controller.store.node_names(RUN, NodeRole.ACTIVE)) == 100


def test_the_writer_hands_an_error_to_its_heartbeat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    controller = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"))

    def broken(body: Heartbeat, now_s: float) -> None:
        raise RuntimeError(f"cannot take {body.node}")

    monkeypatch.setattr(controller, "heartbeat", broken)
    writer = HeartbeatWriter(controller, lambda: 5.0)
    with pytest.raises(RuntimeError, match="cannot take node-7"):
        asyncio.run(writer.take(first_beat("node-7", 7)))


def test_nodes_whose_first_heartbeat_waits_count_for_the_interval_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against the real API, the writer held up: 20 nodes whose first heartbeats wait count as heard from, so a node
    already taken is asked for its ranks every 3 s (21 nodes at 10 heartbeats a second), not every second."""
    config = ControllerConfig(telemetry=TelemetryConfig(heartbeats_per_s=10))
    controller = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"), config)
    controller.heartbeat(first_beat("node-known", 0), time.time())
    held = threading.Event()
    take = controller.heartbeat

    def held_up(body: Heartbeat, now_s: float, *, wait: bool = True) -> HeartbeatReply:
        if body.node != "node-known":  # the writer's thread waits: the known node is taken on the loop
            held.wait(30)
        return take(body, now_s, wait=wait)

    monkeypatch.setattr(controller, "heartbeat", held_up)
    port = free_port()
    server = start_api(controller, CREDENTIALS, "127.0.0.1", port)
    try:
        with ThreadPoolExecutor(20) as pool:
            waiting = [
                pool.submit(
                    request,
                    port,
                    "POST",
                    "/v1/heartbeat",
                    "agent-token",
                    msgspec.json.encode(first_beat(f"node-{i}", i + 1)),
                )
                for i in range(20)
            ]
            wait_for("21 nodes heard from", lambda: len(controller.nodes) == 21, 30)
            assert not any(f.done() for f in waiting)  # every one still waits for the writer
            known = request(
                port, "POST", "/v1/heartbeat", "agent-token", msgspec.json.encode(first_beat("node-known", 0))
            )
            assert known["telemetry_interval_s"] == 3.0
            held.set()
            assert [f.result(30)["telemetry_interval_s"] for f in waiting] == [3.0] * 20
    finally:
        held.set()
        server.should_exit = True
