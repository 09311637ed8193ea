"""The liveness datagrams' endpoint (``opsd.protocol.liveness``): a UDP socket read by a process of its own.

The API binds the socket and starts ``opsd.api.liveness_worker`` with it: that process checks each datagram (size,
version, the tag of an agent's or an operator's key, its clock, a ``seq`` newer than the node's last), acknowledges it
to its sender, who falls back to heartbeats over HTTP while its datagrams go unacknowledged, and hands this process
what it took in batches, 20 a second, on a pipe. Here, on the API's event loop, each batch goes to the controller
(``Controller.alive_many``: the nodes' signs of life, with the time each datagram was taken) and what was refused to
the counters (``opsd_controller_liveness_refused_total``, by reason). Nothing a sender does stops the endpoint.

At 12,288 nodes that is 12,288 datagrams a second taken where nothing else runs, and 20 batches a second on the API's
event loop (docs/controller.md, "Scale"). When the worker ends on its own, the replies stop naming the port, and the
agents send their liveness over HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
from collections import deque

from opsd.api import pipes
from opsd.api.auth import Credentials
from opsd.api.liveness_worker import Batch, WorkerConfig
from opsd.controller.controller import Controller
from opsd.controller.metrics import ApiStats
from opsd.protocol.liveness import liveness_key
from opsd.protocol.states import ApiRole

log = logging.getLogger(__name__)

#: room for ~10,000 datagrams queued while the worker is busy (the kernel caps it at net.core.rmem_max)
RECEIVE_BUFFER_BYTES = 4 << 20
RETRY_S = 0.002  # batches left while the controller's lock was held elsewhere: tried again this much later


class LivenessIngest:
    """The UDP socket, its worker process, and the reading of the worker's batches on the event loop."""

    def __init__(
        self, sock: socket.socket, controller: Controller, stats: ApiStats, worker: subprocess.Popen[bytes], fd: int
    ) -> None:
        self.sock = sock
        self.controller = controller
        self.stats = stats
        self.worker = pipes.WorkerProcess(
            worker, fd, Batch, "the liveness worker", "agents send their liveness over HTTP"
        )
        self.waiting: deque[Batch] = deque()  # read while the controller's lock was held elsewhere, in order
        self.retry: asyncio.TimerHandle | None = None

    def readable(self) -> None:
        batches = self.worker.read()
        if batches is None:  # it ended: the replies stop naming the port
            self.controller.liveness_port = None
            return
        for batch in batches:
            for reason, count in batch.refused.items():
                self.stats.refuse_datagram(reason, count)
        self.waiting.extend(batches)
        if self.retry is None:
            self.take()

    def take(self, wait: bool = False) -> None:
        """Take the batches read, in order, while the controller's lock is free at once (the event loop never waits
        for it); the rest ``RETRY_S`` later. ``wait``: at the end, all of them."""
        self.retry = None
        while self.waiting:
            replays = self.controller.alive_many(self.waiting[0].taken, wait=wait)
            if replays is None:
                self.retry = asyncio.get_running_loop().call_later(RETRY_S, self.take)
                return
            self.waiting.popleft()
            if replays:
                self.stats.refuse_datagram("replay", replays)

    def close(self) -> None:
        if self.retry is not None:
            self.retry.cancel()
        self.take(wait=True)
        self.controller.liveness_port = None
        self.worker.stop()
        self.sock.close()


def start_worker(sock: socket.socket, config: WorkerConfig) -> tuple[subprocess.Popen[bytes], int]:
    """``opsd.api.liveness_worker`` on ``sock``; (the process, the reading end of its batches' pipe)."""
    read_fd, write_fd = pipes.pipe()
    try:
        worker = pipes.start("opsd.api.liveness_worker", {"socket": sock.fileno(), "out": write_fd}, config)
    except OSError:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    os.set_blocking(read_fd, False)
    return worker, read_fd


async def open_liveness(
    controller: Controller,
    credentials: Credentials,
    stats: ApiStats,
    host: str,
    port: int,
) -> LivenessIngest | None:
    """Take liveness datagrams on ``host:port`` (0: any free port); the controller's replies name the port from then
    on. None when the port cannot be bound or its worker not started: agents then send their liveness over HTTP."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    keys = [liveness_key(t) for role, t in credentials.tokens() if role in (ApiRole.AGENT, ApiRole.OPERATOR)]
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
        sock.bind((host, port))
        worker, fd = start_worker(sock, WorkerConfig(keys, controller.config.liveness_max_skew_s))
    except OSError as exc:
        sock.close()
        log.error("no liveness datagrams on udp %s:%d (%s): agents send their liveness over HTTP", host, port, exc)
        return None
    ingest = LivenessIngest(sock, controller, stats, worker, fd)
    asyncio.get_running_loop().add_reader(fd, ingest.readable)
    controller.liveness_port = int(sock.getsockname()[1])
    log.info("liveness datagrams on udp %s:%d (worker %d)", host, controller.liveness_port, worker.pid)
    return ingest


def close_liveness(controller: Controller, ingest: LivenessIngest | None) -> None:
    controller.liveness_port = None
    if ingest is not None:
        ingest.close()
