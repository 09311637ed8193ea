"""The heartbeats' process: ``opsd.api.heartbeat_worker``, started by the API (``opsd.api.heartbeat_ingest``).

It serves ``POST /v1/heartbeat`` on a TCP port of its own (the replies name it: ``heartbeat_port``), with the API's
scheme (HTTPS when the API has a certificate), tokens and answers: 401 or 403 for a token that may not send
heartbeats, 422 naming the field for a body that does not fit (``opsd.api.asgi.judge``), 413 for a body over
``MAX_BODY_BYTES`` and 400 for bytes that are not HTTP (``opsd.api.http1``, its server), each counted. A heartbeat it
can answer as the API would (``Mirror.answer``: a known node of its run, no GPU events) is answered at once, from
what the API's process last told it (``View``: each node's run and acknowledged events, each run's policy, the
interval, the ports), and handed to that process in batches, every ``flush_s`` (50 ms), on a pipe. Any other
heartbeat (a new node or run, GPU events, a run not yet told a policy) is answered ``421``: the agent sends it to the
API's URL, whose reply is the one that writes.

Why a process: at 12,288 nodes the API's process also runs the detection pass, the scoring of ~100,000 ranks and the
collector, on the same interpreter lock as its event loop; the heartbeats' p99 was set by the few stretches in which
the loop waited for it (docs/controller.md, "Scale"). Here nothing else runs.

It ends when its parent does (its pipe closes, or its parent process changes) or on SIGTERM. Started with the
listening socket and the pipes as inherited file descriptors, and its settings (``WorkerConfig``) on standard input
(``opsd.api.pipes``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import uvloop

from opsd.api import http1
from opsd.api.asgi import judge
from opsd.api.auth import Credentials
from opsd.api.http1 import Reply, Request
from opsd.api.interpreter import YOUNG_EVERY_S, collect_young, tune_collector
from opsd.api.pipes import PIPE_BYTES, Frames, encode_frame
from opsd.api.tls import CertificateReload
from opsd.protocol.heartbeat import PATH, SEND_TO_API, Heartbeat, HeartbeatReply
from opsd.protocol.policy_file import Policy

log = logging.getLogger(__name__)

#: connections waiting to be accepted: a 12,288-node job's agents move to the port within a few seconds
BACKLOG = 16384
#: a heartbeat's body is at most this (a node of 8 ranks sends ~5 KB): a larger one is answered 413
MAX_BODY_BYTES = 4 << 20

NodeView = tuple[str, int]  # (its run, the newest of its GPU events acknowledged)


class WorkerConfig(msgspec.Struct, frozen=True):
    operator: str  # the roles' tokens (``opsd.api.auth.Credentials``)
    reader: str = ""
    agent: str = ""
    metrics: str = ""
    previous: tuple[str, ...] = ()  # each role's previous token, in the order above ("": none)
    keep_alive_s: float = 30.0
    tls_certfile: str = ""
    tls_keyfile: str = ""
    tls_reload_every_s: float = 10.0
    flush_s: float = 0.05  # a batch at least this often while heartbeats come


class View(msgspec.Struct, array_like=True):
    """What the API's process tells its heartbeat process, as it changes (the ``View``s applied in order are the
    whole)."""

    interval_s: float | None  # the interval to send the ranks at
    liveness_port: int | None
    heartbeat_port: int | None
    policies: dict[str, Policy]  # run -> the policy for its ranks, for the runs whose policy changed
    runs_gone: list[str]  # runs no longer told a policy
    nodes: dict[str, NodeView]  # the nodes whose record changed
    nodes_gone: list[str]  # nodes that only the API answers from now on


class Taken(msgspec.Struct, array_like=True):
    """What the heartbeat process hands the API's, every ``flush_s``."""

    bodies: list[tuple[bytes, float]]  # (a heartbeat answered, unix seconds when), in the order answered
    refused: dict[str, int]  # reason (``opsd.controller.metrics.REJECTED_REASONS``) -> requests refused since the last
    sent_to_api: int  # heartbeats answered 421 since the last


class Mirror:
    """The heartbeat process's copy of what the API's told it, and the answer to a heartbeat from it."""

    def __init__(self) -> None:
        self.interval_s: float | None = None
        self.liveness_port: int | None = None
        self.heartbeat_port: int | None = None
        self.policies: dict[str, Policy] = {}
        self.nodes: dict[str, NodeView] = {}

    def apply(self, view: View) -> None:
        self.interval_s, self.liveness_port, self.heartbeat_port = (
            view.interval_s,
            view.liveness_port,
            view.heartbeat_port,
        )
        for run in view.runs_gone:
            self.policies.pop(run, None)
        self.policies.update(view.policies)
        for node in view.nodes_gone:
            self.nodes.pop(node, None)
        self.nodes.update(view.nodes)

    def answer(self, body: Heartbeat) -> HeartbeatReply | None:
        """The API's reply to ``body``, or None when only the API can answer it: its node unknown here or not a member
        of a run, a rank of another run (a new one, or the node moved), GPU events, its run not told a policy yet."""
        if body.events or self.heartbeat_port is None:
            return None
        known = self.nodes.get(body.node)
        if known is None:
            return None
        run, acked = known
        if any(r.run != run for r in body.ranks):
            return None
        policy = self.policies.get(run)
        if policy is None:
            return None
        return HeartbeatReply(
            ack_events_up_to=acked,
            policy=None if policy.empty else policy,
            telemetry_interval_s=self.interval_s,
            liveness_port=self.liveness_port,
            heartbeat_port=self.heartbeat_port,
        )


class Answerer:
    """The request handler (``opsd.api.http1``): ``POST /v1/heartbeat``, answered from the ``Mirror``; what it took,
    for the next batch."""

    def __init__(self, credentials: Credentials, mirror: Mirror, clock: Callable[[], float] = time.time) -> None:
        self.credentials = credentials
        self.mirror = mirror
        self.clock = clock
        self.taken: list[tuple[bytes, float]] = []
        self.refused: Counter[str] = Counter()
        self.sent_to_api = 0

    def __call__(self, request: Request) -> Reply:
        if request.path != PATH:
            return _reply(404, {"detail": "Not Found"})
        judged = judge(self.credentials, request.method, request.authorization, request.body)
        if not isinstance(judged, Heartbeat):
            if judged.reason is not None:
                self.refuse(judged.reason)
            return _reply(judged.status, {"detail": judged.detail}, judged.headers)
        reply = self.mirror.answer(judged)
        if reply is None:
            self.sent_to_api += 1
            return _reply(SEND_TO_API, {"detail": "send this heartbeat to the API"})
        self.taken.append((request.body, self.clock()))
        return _reply(200, reply)

    def refuse(self, reason: str) -> None:
        self.refused[reason] += 1

    def batch(self) -> Taken | None:
        """What was taken and refused since the last batch (None: nothing)."""
        if not (self.taken or self.refused or self.sent_to_api):
            return None
        batch = Taken(self.taken, dict(self.refused), self.sent_to_api)
        self.taken, self.refused, self.sent_to_api = [], Counter(), 0
        return batch


def _reply(status: int, payload: Any, headers: list[tuple[bytes, bytes]] | None = None) -> Reply:
    return Reply(status, msgspec.json.encode(payload), headers or [])


class Link:
    """The pipes to the API's process, on this process's event loop: the ``View``s read as they come, the batches
    written every ``flush_s`` (buffered here while the API's process is not reading: this loop never waits for it)."""

    def __init__(self, answerer: Answerer, stop: asyncio.Event, in_fd: int, parent_pid: int) -> None:
        self.answerer = answerer
        self.stop = stop
        self.in_fd = in_fd
        self.parent_pid = parent_pid
        self.frames = Frames(View)
        self.out: asyncio.WriteTransport | None = None

    def readable(self) -> None:
        try:
            data = os.read(self.in_fd, PIPE_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        if not data:
            self.end("the API's process closed its pipe")
            return
        try:
            views = self.frames.feed(data)
        except msgspec.DecodeError as exc:  # never from the API's process of this version: a bug, said loudly
            log.error("heartbeat worker: a view that does not decode: %s", exc)
            return
        for view in views:
            self.answerer.mirror.apply(view)

    def end(self, why: str) -> None:
        log.info("heartbeat worker: %s; ending", why)
        asyncio.get_running_loop().remove_reader(self.in_fd)
        self.stop.set()

    async def flush(self, out_fd: int, flush_s: float) -> None:
        """Every ``flush_s``: the batch written, and the collector's young generations collected every
        ``YOUNG_EVERY_S`` (``opsd.api.interpreter``)."""
        loop = asyncio.get_running_loop()
        self.out, _ = await loop.connect_write_pipe(asyncio.Protocol, os.fdopen(out_fd, "wb", buffering=0))
        collected = loop.time()
        while not self.stop.is_set():
            await asyncio.sleep(flush_s)
            if loop.time() - collected >= YOUNG_EVERY_S:
                collect_young()
                collected = loop.time()
            if os.getppid() != self.parent_pid:
                self.end("its parent is gone")
            elif self.out.is_closing():
                self.end("the API's process closed its pipe")
            else:
                batch = self.answerer.batch()
                if batch is not None:
                    self.out.write(encode_frame(batch))


async def serve(sock: socket.socket, in_fd: int, out_fd: int, config: WorkerConfig, parent_pid: int) -> None:
    credentials = Credentials(config.operator, config.reader, config.agent, config.metrics, *config.previous)
    answerer = Answerer(credentials, Mirror())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    link = Link(answerer, stop, in_fd, parent_pid)
    os.set_blocking(in_fd, False)
    loop.add_reader(in_fd, link.readable)
    flushing = asyncio.create_task(link.flush(out_fd, config.flush_s))
    tls = http1.tls_context(config.tls_certfile, config.tls_keyfile)
    background = [flushing]
    if tls is not None:
        reload = CertificateReload(tls, config.tls_certfile, config.tls_keyfile)
        background.append(asyncio.create_task(reload.every(config.tls_reload_every_s)))
    try:
        await http1.serve(
            sock,
            answerer,
            refuse=answerer.refuse,
            stop=stop,
            keep_alive_s=config.keep_alive_s,
            max_body_bytes=MAX_BODY_BYTES,
            backlog=BACKLOG,
            tls=tls,
        )
    finally:
        for task in background:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="opsd.api.heartbeat_worker", description=__doc__.splitlines()[0])
    p.add_argument("--socket-fd", type=int, required=True, help="the listening TCP socket, inherited")
    p.add_argument("--in-fd", type=int, required=True, help="the reading end of the views' pipe, inherited")
    p.add_argument("--out-fd", type=int, required=True, help="the writing end of the batches' pipe, inherited")
    p.add_argument("--parent-pid", type=int, required=True, help="ends when its parent is no longer this one")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # until its event loop takes it over: it ends the same way
    try:
        config = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=WorkerConfig)
        Credentials(config.operator, config.reader, config.agent, config.metrics, *config.previous)
    except (msgspec.DecodeError, ValueError) as exc:
        log.error("heartbeat worker: its settings on standard input: %s", exc)
        return 2
    sock = socket.socket(fileno=args.socket_fd)
    tune_collector()
    uvloop.run(serve(sock, args.in_fd, args.out_fd, config, args.parent_pid))
    return 0


if __name__ == "__main__":
    sys.exit(main())
