"""The heartbeats answered apart: a TCP port served by a process of its own (``opsd.api.heartbeat_worker``).

The API binds the port and starts the process on it. From then on every reply names the port (``heartbeat_port``),
and agents send their heartbeats there; that process answers a known node's heartbeat at once, from what this process
tells it (``View``), and sends the others back here (421). Here, on the API's event loop:

- its batches (every 50 ms) are taken under one hold of the controller's lock (``Controller.take_many``, never
  waited for: tried again ``RETRY_S`` later), what it refused counted with the API's refusals, by reason;
- every ``flush_s`` it is told what changed: each run's policy, the record of each node heard from since (its run,
  its GPU events acknowledged; none while it has events waiting for their incident), the interval and the ports.

At 12,288 nodes the API's event loop then takes 20 batches a second instead of ~1,400 requests, and the heartbeats
are answered where nothing else runs (docs/controller.md, "Scale"). When the process ends on its own, the replies
stop naming the port, and agents send their heartbeats to the API again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
from dataclasses import dataclass
from typing import Any

from opsd.api import pipes
from opsd.api.auth import Credentials
from opsd.api.heartbeat_worker import BACKLOG, NodeView, Taken, View, WorkerConfig
from opsd.api.liveness import RETRY_S
from opsd.api.writer import HeartbeatWriter
from opsd.controller.controller import Controller
from opsd.controller.metrics import ApiStats
from opsd.errors import OpsError
from opsd.protocol.heartbeat import Heartbeat, decode_heartbeat
from opsd.protocol.policy_file import Policy

log = logging.getLogger(__name__)

FLUSH_S = 0.05


@dataclass(frozen=True)
class HeartbeatPort:
    """Where the heartbeat process listens, and how."""

    host: str
    port: int  # 0: any free port
    keep_alive_s: float = 30.0
    tls_certfile: str = ""
    tls_keyfile: str = ""
    tls_reload_every_s: float = 10.0  # the certificate's files read again this often (``opsd.api.tls``)


class Told:
    """What the heartbeat process was told, and what to tell it next (``View``: what changed since)."""

    def __init__(self) -> None:
        self.scalars: tuple[float | None, int | None, int | None] | None = None
        self.policies: dict[str, Policy] = {}
        self.nodes: dict[str, NodeView] = {}

    def view(self, controller: Controller, heard: set[str]) -> View | None:
        """What changed: the scalars, each run's policy, the record of each node in ``heard``; None: nothing."""
        scalars = (controller.telemetry.interval_s, controller.liveness_port, controller.heartbeat_port)
        policies = controller.policies()
        changed = {run: p for run, p in policies.items() if self.policies.get(run) != p}
        runs_gone = [run for run in self.policies if run not in policies]
        nodes: dict[str, NodeView] = {}
        nodes_gone = []
        for node in heard:
            now = node_view(controller, node)
            if now == self.nodes.get(node):
                continue
            if now is None:
                del self.nodes[node]
                nodes_gone.append(node)
            else:
                nodes[node] = self.nodes[node] = now
        for run in runs_gone:
            del self.policies[run]
        self.policies.update(changed)
        if scalars == self.scalars and not (changed or runs_gone or nodes or nodes_gone):
            return None
        self.scalars = scalars
        return View(*scalars, changed, runs_gone, nodes, nodes_gone)


def node_view(controller: Controller, node: str) -> NodeView | None:
    """What the heartbeat process needs to answer ``node`` as the API would: its run and its GPU events acknowledged;
    None when only the API answers it (not a member of a run, or GPU events waiting for their incident)."""
    row = controller.store.node(node)
    if row is None or row.run is None:
        return None
    live = controller.nodes.get(node)
    if live is not None and live.events:
        return None
    return row.run, int(row.events_acked)


class HeartbeatIngest:
    """The listening socket, its process, and on the event loop: its batches read and taken, the views written."""

    def __init__(
        self,
        sock: socket.socket,
        controller: Controller,
        stats: ApiStats,
        writer: HeartbeatWriter,
        heard: set[str],
        worker: subprocess.Popen[bytes],
        read_fd: int,
    ) -> None:
        self.sock = sock
        self.controller = controller
        self.stats = stats
        self.writer = writer
        self.heard = heard  # nodes heard from (here, or by the API's endpoint) since the last view
        self.worker = pipes.WorkerProcess(
            worker, read_fd, Taken, "the heartbeat process", "agents send their heartbeats to the API"
        )
        self.told = Told()
        self.out: asyncio.WriteTransport | None = None
        self.waiting: list[tuple[Heartbeat, float]] = []  # read while the controller's lock was held, in order
        self.retry: asyncio.TimerHandle | None = None
        self.pushing: asyncio.TimerHandle | None = None
        self.writing: set[asyncio.Task[Any]] = set()

    def readable(self) -> None:
        batches = self.worker.read()
        if batches is None:  # it ended: the replies stop naming the port
            self.controller.heartbeat_port = None
            return
        for batch in batches:
            for reason, count in batch.refused.items():
                self.stats.reject(reason, count)
            self.stats.heartbeats_sent_to_api += batch.sent_to_api
            self.stats.heartbeats_apart += len(batch.bodies)
            for data, taken_s in batch.bodies:
                self._read(data, taken_s)
        if self.retry is None:
            self.take()

    def _read(self, data: bytes, taken_s: float) -> None:
        try:
            body = decode_heartbeat(data)  # that process decoded it: it does here too
        except OpsError as exc:
            log.error("a heartbeat from the heartbeat process that does not decode: %s", exc)
            return
        self.heard.add(body.node)
        if self.controller.heartbeat_writes(body):  # its node or run is new to the store since that process was told
            task = asyncio.get_running_loop().create_task(self.writer.take(body))
            self.writing.add(task)
            task.add_done_callback(self._written)
        else:
            self.waiting.append((body, taken_s))

    def _written(self, task: asyncio.Task[Any]) -> None:
        self.writing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("a heartbeat answered apart, not taken: %s", task.exception())

    def take(self, wait: bool = False) -> None:
        """Take the heartbeats read, in order, while the controller's lock is free at once (the event loop never
        waits for it); else ``RETRY_S`` later. ``wait``: at the end, all of them."""
        self.retry = None
        if self.waiting and not self.controller.take_many(self.waiting, wait=wait):
            self.retry = asyncio.get_running_loop().call_later(RETRY_S, self.take)
            return
        self.waiting = []

    def push(self) -> None:
        """Tell the process what changed; again ``FLUSH_S`` later."""
        heard = set(self.heard)
        self.heard.clear()
        view = self.told.view(self.controller, heard)
        if view is not None and self.out is not None and not self.out.is_closing():
            self.out.write(pipes.encode_frame(view))
        self.pushing = asyncio.get_running_loop().call_later(FLUSH_S, self.push)

    def close(self) -> None:
        self.controller.heartbeat_port = None
        for handle in (self.retry, self.pushing):
            if handle is not None:
                handle.cancel()
        self.take(wait=True)
        if self.out is not None:
            self.out.close()
        self.worker.stop()
        self.sock.close()


async def open_heartbeats(
    controller: Controller,
    credentials: Credentials,
    stats: ApiStats,
    writer: HeartbeatWriter,
    heard: set[str],
    where: HeartbeatPort,
) -> HeartbeatIngest | None:
    """Answer heartbeats on ``where`` by a process of its own; the replies name its port from then on. None when the
    port cannot be bound or the process not started: agents then send their heartbeats to the API."""
    family = socket.AF_INET6 if ":" in where.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    config = WorkerConfig(
        credentials.operator,
        credentials.reader,
        credentials.agent,
        credentials.metrics,
        previous=(
            credentials.operator_previous,
            credentials.reader_previous,
            credentials.agent_previous,
            credentials.metrics_previous,
        ),
        keep_alive_s=where.keep_alive_s,
        tls_certfile=where.tls_certfile,
        tls_keyfile=where.tls_keyfile,
        tls_reload_every_s=where.tls_reload_every_s,
        flush_s=FLUSH_S,
    )
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((where.host, where.port))
        sock.listen(BACKLOG)
        views_read, views_write = pipes.pipe()
        batches_read, batches_write = pipes.pipe()
        fds = {"socket": sock.fileno(), "in": views_read, "out": batches_write}
        try:
            worker = pipes.start("opsd.api.heartbeat_worker", fds, config)
        except OSError:
            for fd in (views_write, batches_read):
                os.close(fd)
            raise
        finally:
            for fd in (views_read, batches_write):
                os.close(fd)
    except OSError as exc:
        sock.close()
        where_s = f"{where.host}:{where.port}"
        log.error("no heartbeat process on tcp %s (%s): agents send their heartbeats to the API", where_s, exc)
        return None
    ingest = HeartbeatIngest(sock, controller, stats, writer, heard, worker, batches_read)
    loop = asyncio.get_running_loop()
    os.set_blocking(batches_read, False)
    loop.add_reader(batches_read, ingest.readable)
    ingest.out, _ = await loop.connect_write_pipe(asyncio.Protocol, os.fdopen(views_write, "wb", buffering=0))
    controller.heartbeat_port = int(sock.getsockname()[1])
    ingest.push()
    log.info("heartbeats answered on tcp %s:%d (process %d)", where.host, controller.heartbeat_port, worker.pid)
    return ingest


def close_heartbeats(controller: Controller, ingest: HeartbeatIngest | None) -> None:
    controller.heartbeat_port = None
    if ingest is not None:
        ingest.close()
