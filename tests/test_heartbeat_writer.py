"""What a job of many nodes starting costs the controller: its nodes' first heartbeats written in one transaction
(``StateStore.activate_nodes``, ``Controller.register``, the API's ``HeartbeatWriter``), and liveness datagrams
taken by the thousand at each wake-up of the API's loop (uvloop's datagram transport takes 32)."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import msgspec
import pytest
from sqlalchemy import event

from opsd.api.liveness import DRAIN_MAX
from opsd.api.writer import HeartbeatWriter
from opsd.backends.local.processes import free_port
from opsd.controller.controller import Controller
from opsd.controller.state import StateStore
from opsd.protocol.heartbeat import Heartbeat
from opsd.protocol.liveness import Signer, decode_ack, encode_alive, liveness_key
from opsd.protocol.states import NodeRole
from tests.serving import start_api
from tests.test_liveness import CREDENTIALS

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


def test_a_burst_of_datagrams_is_taken_in_full(tmp_path: Path) -> None:
    """2,000 datagrams at once, more than one wake-up takes (``DRAIN_MAX``): every one taken and acknowledged."""
    controller = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"))
    server = start_api(controller, CREDENTIALS, "127.0.0.1", free_port())
    try:
        port = controller.liveness_port
        assert port is not None
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        sock.connect(("127.0.0.1", port))
        signer = Signer(liveness_key("agent-token"))
        seq = int(time.time() * 1000)
        sent = {encode_alive(f"node-{i}", seq, signer)[-16:] for i in range(2000)}
        for i in range(2000):
            sock.send(encode_alive(f"node-{i}", seq, signer))
        acked: set[bytes] = set()
        sock.settimeout(10)
        while len(acked) < len(sent):
            acked.add(decode_ack(sock.recv(64))[1])
        assert acked == sent
        assert len(sent) > DRAIN_MAX
        assert controller.datagrams_total == 2000
    finally:
        server.should_exit = True
