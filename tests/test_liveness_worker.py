"""The liveness worker (``opsd.api.liveness_worker``): its checks as a table, its frames cut anywhere, and the real
process: beside the real API (every datagram of a burst acknowledged and taken; the API going on without it when it
dies), and alone (it ends when its parent does, and refuses bad settings)."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import cast

import msgspec
import pytest

from opsd.api.liveness import LivenessIngest
from opsd.api.liveness_worker import DRAIN_MAX, Batch, Checker, WorkerConfig
from opsd.api.pipes import Frames, encode_frame
from opsd.backends.local.processes import free_port
from opsd.controller.controller import Controller
from opsd.controller.metrics import ApiStats
from opsd.controller.state import StateStore
from opsd.protocol.heartbeat import VERSION, Heartbeat, HeartbeatReply
from opsd.protocol.liveness import Signer, decode_ack, encode_alive, liveness_key
from tests.serving import start_api
from tests.test_liveness import CREDENTIALS, request
from tests.waiting import wait_for

AGENT, READER = Signer(liveness_key("agent-token")), Signer(liveness_key("reader-token"))
NOW_S = 1_800_000_000.0
SEQ = int(NOW_S * 1000)
GOOD = encode_alive("node-1", SEQ, AGENT)

#: a datagram (after those before it in the list, for the replay) -> what the worker does with it
CASES: dict[str, tuple[list[bytes], tuple[str, int] | str]] = {
    "a signed datagram of now": ([GOOD], ("node-1", SEQ)),
    "not a liveness datagram": ([b"garbage"], "malformed"),
    "another version": ([GOOD[:4] + b"\x07" + GOOD[5:]], "version"),
    "signed with a key that may not send heartbeats": ([encode_alive("node-1", SEQ, READER)], "mac"),
    "an hour old": ([encode_alive("node-1", SEQ - 3_600_000, AGENT)], "skew"),
    "the same datagram again": ([GOOD, GOOD], "replay"),
    "an older one after a newer": ([encode_alive("node-1", SEQ + 5, AGENT), GOOD], "replay"),
    "a newer one after": ([GOOD, encode_alive("node-1", SEQ + 1, AGENT)], ("node-1", SEQ + 1)),
    "another node's same seq": ([GOOD, encode_alive("node-2", SEQ, AGENT)], ("node-2", SEQ)),
}


@pytest.mark.parametrize(("datagrams", "expected"), list(CASES.values()), ids=list(CASES))
def test_the_worker_checks(datagrams: list[bytes], expected: tuple[str, int] | str) -> None:
    checker = Checker(WorkerConfig([liveness_key("agent-token")], max_skew_s=60.0))
    for data in datagrams[:-1]:
        checker.check(data, NOW_S)
    checked = checker.check(datagrams[-1], NOW_S)
    assert (checked if isinstance(checked, str) else checked[:2]) == expected
    if not isinstance(checked, str):
        assert checked[2] == datagrams[-1][-16:]  # the tag its acknowledgement echoes


def test_frames_cut_anywhere_come_out_whole() -> None:
    batches = [Batch([(f"node-{i}", i, 1.5 * i) for i in range(n)], {"mac": n}) for n in (0, 1, 300)]
    data = b"".join(encode_frame(b) for b in batches)
    for cut in (1, 3, 7, 1000, len(data)):
        frames = Frames(Batch)
        out = [b for i in range(0, len(data), cut) for b in frames.feed(data[i : i + cut])]
        assert out == batches
    frames, bad = Frames(Batch), encode_frame(batches[0])[:4] + b"\xc1" * len(encode_frame(batches[0])[4:])
    with pytest.raises(msgspec.DecodeError):
        frames.feed(bad)
    assert frames.feed(encode_frame(batches[2])) == [batches[2]]  # the bad frame dropped, the next one whole


def test_a_burst_of_datagrams_is_taken_in_full(tmp_path: Path) -> None:
    """2,500 datagrams at once, more than the worker takes before it looks at its flush (``DRAIN_MAX``): every one
    acknowledged, and every one taken by the controller."""
    controller = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"))
    server = start_api(controller, CREDENTIALS, "127.0.0.1", free_port())
    try:
        port = controller.liveness_port
        assert port is not None
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        sock.connect(("127.0.0.1", port))
        seq = int(time.time() * 1000)
        datagrams = [encode_alive(f"node-{i}", seq, AGENT) for i in range(2500)]
        assert len(datagrams) > DRAIN_MAX
        for data in datagrams:
            sock.send(data)
        acked: set[bytes] = set()
        sock.settimeout(10)
        while len(acked) < len(datagrams):
            acked.add(decode_ack(sock.recv(64))[1])
        assert acked == {d[-16:] for d in datagrams}
        wait_for("every datagram taken", lambda: controller.datagrams_total == len(datagrams), 10)
        assert all(controller.nodes[f"node-{i}"].liveness_seq == seq for i in range(len(datagrams)))
    finally:
        server.should_exit = True


def test_the_api_goes_on_without_a_worker_that_died(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The worker killed: the replies stop naming the port (agents then send their liveness over HTTP), the API
    answers heartbeats, and the error says what happened."""
    controller = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"))
    port = free_port()
    with caplog.at_level(logging.INFO, logger="opsd.api.liveness"):
        server = start_api(controller, CREDENTIALS, "127.0.0.1", port)
    started = re.search(
        rf"liveness datagrams on udp 127.0.0.1:{controller.liveness_port} \(worker (\d+)\)", caplog.text
    )
    assert started is not None, caplog.text
    beat = msgspec.json.encode(Heartbeat(v=VERSION, node="n-1", time_unix_s=time.time()))
    try:
        assert msgspec.convert(
            request(port, "POST", "/v1/heartbeat", "agent-token", beat), HeartbeatReply
        ).liveness_port
        with caplog.at_level(logging.ERROR, logger="opsd.api.pipes"):
            os.kill(int(started.group(1)), 9)
            wait_for("the API to see its worker gone", lambda: controller.liveness_port is None, 10)
            reply = msgspec.convert(request(port, "POST", "/v1/heartbeat", "agent-token", beat), HeartbeatReply)
            assert reply.liveness_port is None
            wait_for("the error logged", lambda: "the liveness worker ended (exit status -9)" in caplog.text, 10)
    finally:
        server.should_exit = True


class Lingering:
    """A worker process that closed its end of the pipe but does not exit until ``gone`` is set; its ``wait`` then
    times out."""

    def __init__(self) -> None:
        self.gone = threading.Event()

    def wait(self, timeout: float) -> int:
        self.gone.wait(timeout)
        raise subprocess.TimeoutExpired("opsd.api.liveness_worker", timeout)


def test_a_worker_that_lingers_does_not_hold_the_event_loop_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The loop goes on while the worker is waited for (on a thread); then the error says what happened."""
    controller = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"))
    controller.liveness_port = 8470
    read_fd, write_fd = os.pipe()
    os.close(write_fd)  # the worker's end, closed
    lingering = Lingering()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        worker = cast("subprocess.Popen[bytes]", lingering)
        ingest = LivenessIngest(
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM), controller, ApiStats(), worker, read_fd
        )
        loop.add_reader(read_fd, ingest.readable)
        while ingest.worker.reaping is None:
            await asyncio.sleep(0.01)
        for _ in range(20):  # the loop ticks on while the worker lingers
            await asyncio.sleep(0.01)
        assert not ingest.worker.reaping.done()
        lingering.gone.set()
        await ingest.worker.reaping
        os.close(read_fd)
        ingest.sock.close()

    with caplog.at_level(logging.ERROR, logger="opsd.api.pipes"):
        asyncio.run(asyncio.wait_for(main(), 30))
    assert controller.liveness_port is None
    assert "the liveness worker ended (exit status None)" in caplog.text


def worker(parent_pid: int, settings: bytes) -> tuple[subprocess.Popen[bytes], socket.socket, int]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    read_fd, write_fd = os.pipe()
    command = [sys.executable, "-m", "opsd.api.liveness_worker", "--socket-fd", str(sock.fileno())]
    command += ["--out-fd", str(write_fd), "--parent-pid", str(parent_pid)]
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(sock.fileno(), write_fd))
    os.close(write_fd)
    assert proc.stdin is not None
    with proc.stdin:
        proc.stdin.write(settings)
    return proc, sock, read_fd


def test_the_worker_ends_with_its_parent_and_refuses_bad_settings() -> None:
    settings = msgspec.msgpack.encode(WorkerConfig([liveness_key("agent-token")], 60.0))
    orphan, sock, fd = worker(parent_pid=1, settings=settings)  # not its parent: as if its parent had died
    try:
        assert orphan.wait(10) == 0
    finally:
        sock.close()
        os.close(fd)
    bad, sock, fd = worker(parent_pid=os.getpid(), settings=b"\x93not settings")
    try:
        assert bad.wait(10) == 2
        assert bad.stderr is not None
        assert b"its settings on standard input" in bad.stderr.read()
    finally:
        sock.close()
        os.close(fd)
