"""The simulated agents of ``bench.controller_scale``: what ``opsd agent`` sends, from asyncio load-generator
processes, each node on a keep-alive connection of its own.

Each node beats once a second at its phase. Like the agent (``opsd_agent.reporter``), it sends a heartbeat with its
ranks (``opsd.protocol.heartbeat``) at the interval the controller's replies ask for, in its own slot of the interval
(``opsd.policy.telemetry.ranks_due``), and a signed liveness datagram (``opsd.protocol.liveness``) every beat once a
reply named the controller's datagram port; ``--mode http`` is an agent that knows neither (a heartbeat with the
ranks every beat, as agents did before). The datagrams of a load process go from one UDP socket; their
acknowledgements come back to it.

A heartbeat: the node's ranks with their step advancing every ``STEP_S`` until the silent node dies (from then on no
rank of the synchronous job steps: the controller's second witness of a lost node, ``opsd.policy.detection``),
``step_s``, ``compute_s``, the running sums ``steps_total`` and ``compute_total_s``, checkpoints so far, mesh
coordinates (tp=8, pp=16, dp for the rest), one node summary, and the node's collective time by phase, dimension and
op (18 rows, for the flame graph); one rank computes 1.3x slower than its peers.
"""

from __future__ import annotations

import array
import asyncio
import json
import logging
import math
import random
import re
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.synchronize import Event
from typing import Any, cast

import uvloop

from opsd.policy.telemetry import phase_ratio, ranks_due
from opsd.protocol.heartbeat import VERSION, CommRow, Heartbeat, HeartbeatRank, NodeSummary, encode
from opsd.protocol.liveness import LivenessError, Signer, decode_ack, encode_alive, liveness_key

log = logging.getLogger(__name__)

RUN = "bench"
COMMS = [  # (phase, dimension, op, share of the step): 3 phases x 6 pairs
    (phase, dim, op, 0.01)
    for phase in ("forward", "backward", "optimizer")
    for dim, op in (
        ("dp_shard", "all_gather"),
        ("dp_shard", "reduce_scatter"),
        ("tp", "all_reduce"),
        ("pp", "send"),
        ("pp", "recv"),
        ("dp_replicate", "all_reduce"),
    )
]
TOKEN = "bench-token"
STEP_S = 0.5  # the simulated job's step time
COMPUTE_S = 0.45  # its compute time per step (the rest: exposed communication)
SLOW_RANK = 1  # computes 1.3x slower than its peers
CHECKPOINT_EVERY = 100  # steps
CHECKPOINT_BLOCKING_S = 2.5
FIRST_STEP = 1000  # the run has been going on for a while
TP, PP = 8, 16
POLL_S = 0.25
PACE_S = 0.005  # the load processes send what is due every 5 ms
STOP_WAIT_S = 10.0  # how long the load waits for the replies under way once told to stop
SILENT_BEFORE_END_S = 10.0  # the silent node stops this long before the window ends (at its start if shorter)
_LENGTH = re.compile(rb"content-length:\s*(\d+)", re.I)


@dataclass(frozen=True)
class Plan:
    """What every load generator needs to know; times are wall-clock (``time.time()``), shared by the processes."""

    host: str
    port: int
    nodes: int
    gpus_per_node: int
    start_s: float  # heartbeats begin
    window_s: tuple[float, float]  # latencies are kept for heartbeats sent in [begin, end)
    silent_node: int
    silent_s: float  # the silent node sends nothing from then on, and the other nodes' ranks step no more
    datagrams: bool = True  # False: agents that know no liveness datagrams nor intervals (a heartbeat every beat)
    ramp_s: float = 0.0  # the agents come up over this long from start_s, in the order of their index

    def __post_init__(self) -> None:
        if self.nodes < 2 or self.gpus_per_node < 1:
            raise ValueError("controller_scale needs at least 2 nodes and 1 GPU per node")


def node_name(index: int) -> str:
    return f"node-{index:05d}"


class SimulatedAgent:
    """One node's agent: its ranks' running sums, and the bytes of its next heartbeat request."""

    def __init__(self, index: int, plan: Plan, run_start_s: float) -> None:
        self.name = node_name(index)
        self.run_start_s = run_start_s
        self.stalled_s = plan.silent_s  # the silent node dies then: a synchronous job's ranks step no more
        self.rng = random.Random(index)
        gpus = plan.gpus_per_node
        self.ranks = list(range(index * gpus, (index + 1) * gpus))
        self.factors = [1.3 if r == SLOW_RANK else 1.0 for r in self.ranks]
        self.steps = [0] * gpus
        self.compute_totals_s = [0.0] * gpus
        self.coords = [
            {"dp_replicate": 0, "dp_shard": r // (TP * PP), "cp": 0, "pp": (r // TP) % PP, "tp": r % TP}
            for r in self.ranks
        ]
        self.head = (
            f"POST /v1/heartbeat HTTP/1.1\r\nhost: {plan.host}:{plan.port}\r\ncontent-type: application/json\r\n"
            f"authorization: Bearer {TOKEN}\r\ncontent-length: %d\r\n\r\n"
        )
        self.world_size = plan.nodes * plan.gpus_per_node
        self.tokens_per_s = 4096 * self.world_size / STEP_S
        self.interval_s: float | None = None  # the ranks' interval the controller asks for (None: every beat)
        self.port: int | None = None  # its liveness datagrams' port
        self.heartbeat_port: int | None = None  # the controller's heartbeat process (None: the API)
        self.seq = 0
        self.phase_ratio = phase_ratio(self.name)  # where in each interval it sends its ranks, as the agent does

    def heartbeat(self, now_s: float) -> Heartbeat:
        elapsed = min(now_s, self.stalled_s) - self.run_start_s
        step = FIRST_STEP + int(elapsed / STEP_S)
        last_report_s = self.run_start_s + (step - FIRST_STEP) * STEP_S
        checkpoints = step // CHECKPOINT_EVERY
        ranks = []
        step_s_max = 0.0
        for i, rank in enumerate(self.ranks):
            new = step - self.steps[i] if self.steps[i] else step
            compute_s = COMPUTE_S * self.factors[i] * (1.0 + self.rng.uniform(-0.02, 0.02))
            self.steps[i] = step
            self.compute_totals_s[i] += new * compute_s
            step_s = max(STEP_S, compute_s + 0.02)
            step_s_max = max(step_s_max, step_s)
            ranks.append(
                HeartbeatRank(
                    run=RUN,
                    rank=rank,
                    host=self.name,
                    step=step,
                    step_s=step_s,
                    compute_s=compute_s,
                    steps_total=step,
                    compute_total_s=self.compute_totals_s[i],
                    mfu_ratio=0.41,
                    job_tokens_per_s=self.tokens_per_s,
                    checkpoints=checkpoints,
                    checkpoint_blocking_s=checkpoints * CHECKPOINT_BLOCKING_S,
                    last_report_unix_s=last_report_s,
                    coords=self.coords[i],
                    world_size=self.world_size,
                )
            )
        summary = NodeSummary(
            time_unix_s=now_s, ranks=len(ranks), step_s_max=step_s_max, step_s_mean=STEP_S, mfu_ratio_mean=0.41
        )
        comms: list[CommRow] = [  # the node's collective time by phase, dimension and op, cumulative (18 rows)
            (RUN, phase, dim, op, step * share * STEP_S * len(ranks), step, step << 20)
            for phase, dim, op, share in COMMS
        ]
        return Heartbeat(
            v=VERSION,
            node=self.name,
            time_unix_s=now_s,
            ranks=ranks,
            summaries=[summary],
            comms=comms,
        )

    def request(self, now_s: float) -> bytes:
        body = encode(self.heartbeat(now_s))
        return (self.head % len(body)).encode() + body

    def alive(self, now_s: float, signer: Signer) -> bytes:
        self.seq = max(self.seq + 1, int(now_s * 1000))
        return encode_alive(self.name, self.seq, signer)

    def answered(self, body: bytes, datagrams: bool) -> None:
        """What a reply asks for from now on (an agent that knows no datagrams reads nothing of it)."""
        if not datagrams:
            return
        reply = json.loads(body)
        self.interval_s = reply.get("telemetry_interval_s")
        self.port = reply.get("liveness_port")
        self.heartbeat_port = reply.get("heartbeat_port")


@dataclass
class Tally:
    latencies_ms: array.array[float]  # heartbeats: request written to reply read
    datagram_ms: array.array[float]  # liveness datagrams: sent to acknowledgement received
    lag_ms: array.array[float]  # the load process's event loop: how late its pacer woke (within the window)
    ok: int = 0  # heartbeats answered 200 within the window
    errors: int = 0
    late: int = 0  # beats more than 0.5 s after their time (the previous one took that long)
    silent_last_s: float = 0.0  # the silent node's last sign of life
    datagrams: int = 0  # liveness datagrams sent within the window
    pending: dict[bytes, tuple[float, bool]] = field(default_factory=dict)  # tag -> (sent, within the window)


class Acknowledgements:
    """The load process's UDP socket: acknowledgements timed against their datagrams, every one queued taken at each
    wake-up of the loop (uvloop's datagram transport takes 32 a turn: behind a turn that builds heartbeats, the
    acknowledgements queued up and were timed late)."""

    def __init__(self, sock: socket.socket, tally: Tally) -> None:
        self.sock = sock
        self.tally = tally

    def readable(self) -> None:
        while True:
            try:
                data = self.sock.recv(64)
            except (BlockingIOError, InterruptedError):
                return
            try:
                _, tag = decode_ack(data)
            except LivenessError:
                continue
            sent = self.tally.pending.pop(tag, None)
            if sent is not None and sent[1]:
                self.tally.datagram_ms.append((time.perf_counter() - sent[0]) * 1000.0)

    def send(self, data: bytes, to: tuple[str, int]) -> None:
        try:
            self.sock.sendto(data, to)
        except OSError as exc:  # a full send buffer: counted as not acknowledged
            log.debug("liveness datagram: %s", exc)


class Node:
    """A simulated agent in its load process: what it sends, its connection, and whether a heartbeat is due."""

    def __init__(self, index: int, plan: Plan) -> None:
        self.index = index
        self.agent = SimulatedAgent(index, plan, plan.start_s - 3600.0)
        self.due = asyncio.Event()  # a heartbeat is due (set by the pacer, at the beat)
        self.beat_s = 0.0  # when it was due
        self.busy = False  # a heartbeat under way
        self.delivered_s = -math.inf
        self.connections: dict[int, Exchange] = {}  # port -> its connection
        self.up_s = plan.start_s + plan.ramp_s * index / plan.nodes  # its agent starts then


async def pace(plan: Plan, nodes: list[Node], stop: Event, tally: Tally, udp: Acknowledgements, signer: Signer) -> None:
    """The beats of the process's nodes, each once a second at its phase: its liveness datagram sent here, its
    heartbeat handed to its coroutine when due. One loop wakes every ``PACE_S`` for the nodes due by then (a
    coroutine woken for each node's beat cost the load more than the controller's work)."""
    begin, end = plan.window_s
    n = len(nodes)
    phases = [plan.start_s + node.index / plan.nodes for node in nodes]  # ascending
    k, cycle = 0, 0
    while True:
        due = phases[k] + cycle
        now = time.time()
        if due > now:
            if stop.is_set():  # looked at between beats only: it takes a lock shared with the other processes
                return
            slept = time.perf_counter()
            await asyncio.sleep(PACE_S)
            if begin <= now < end:
                tally.lag_ms.append(max(0.0, time.perf_counter() - slept - PACE_S) * 1000.0)
            continue
        node = nodes[k]
        k += 1
        if k == n:  # the next second; a second or more behind: no burst to catch up, on from the current one
            k, cycle = 0, max(cycle + 1, int(now - phases[0]))
            if stop.is_set():  # and once a second when it never waits
                return
        if now < node.up_s:
            continue
        window = begin <= now < end
        if now - due > 0.5:
            tally.late += window  # the load process fell behind
        if node.index == plan.silent_node:
            if now >= plan.silent_s:
                continue
            tally.silent_last_s = now
        agent = node.agent
        if agent.port is not None:
            data = agent.alive(now, signer)
            tally.pending[data[-16:]] = (time.perf_counter(), window)
            tally.datagrams += window
            udp.send(data, (plan.host, agent.port))
        interval_s = agent.interval_s
        if interval_s is None or ranks_due(
            now_s=now, delivered_s=node.delivered_s, interval_s=interval_s, phase_ratio=agent.phase_ratio
        ):
            if node.busy:
                tally.late += window  # its last heartbeat is still under way
            else:
                node.beat_s, node.busy = now, True
                node.due.set()


class Exchange(asyncio.Protocol):
    """A node's keep-alive connection to one port: one request at a time, its reply timed when its last bytes are
    read, as the datagrams' acknowledgements are (``Acknowledgements``). Timed when the coroutine that awaits it ran
    next, a reply would wait behind the load process's other work of that turn (the heartbeats it builds, the
    datagrams it sends): the load's own delay, not the controller's."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.reply: asyncio.Future[tuple[bytes, bytes, float]] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's TCP transport, not a subclass of it

    def data_received(self, data: bytes) -> None:
        read_s = time.perf_counter()
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0 or self.reply is None:
            return
        head = bytes(self.buffer[: end + 4])
        found = _LENGTH.search(head)
        size = int(found.group(1)) if found else 0
        if len(self.buffer) < end + 4 + size:
            return
        body = bytes(self.buffer[end + 4 : end + 4 + size])
        del self.buffer[: end + 4 + size]
        if not self.reply.done():
            self.reply.set_result((head, body, read_s))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.reply is not None and not self.reply.done():
            self.reply.set_exception(ConnectionResetError("the controller closed the connection"))

    async def send(self, data: bytes) -> tuple[bytes, bytes, float]:
        """(head, body, when its last bytes were read: ``time.perf_counter()``)."""
        assert self.transport is not None
        self.reply = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return await self.reply


async def exchange(node: Node, host: str, port: int, data: bytes) -> tuple[bytes, bytes, float]:
    """One request on the node's keep-alive connection to ``port`` (opened when it has none): (head, body, when it was
    read)."""
    connection = node.connections.get(port)
    if connection is None or connection.transport is None:
        _, connection = await asyncio.get_running_loop().create_connection(Exchange, host, port)
        node.connections[port] = connection
    try:
        return await connection.send(data)
    except OSError:
        del node.connections[port]
        if connection.transport is not None:
            connection.transport.close()
        raise


async def drive(node: Node, plan: Plan, tally: Tally) -> None:
    """One agent's heartbeats, each when the pacer says, on keep-alive connections (opened again after an error): to
    the controller's heartbeat process once a reply names it (to the API for what it sends back: 421), else to the
    API."""
    begin, end = plan.window_s
    try:
        while True:
            await node.due.wait()
            node.due.clear()
            now = node.beat_s
            window = begin <= now < end
            apart = node.agent.heartbeat_port if plan.datagrams else None
            try:
                data = node.agent.request(now)
                sent = time.perf_counter()
                head = b""
                if apart is not None:
                    head, body, read_s = await exchange(node, plan.host, apart, data)
                if not head.startswith(b"HTTP/1.1 200"):
                    head, body, read_s = await exchange(node, plan.host, plan.port, data)
                took_ms = (read_s - sent) * 1000.0
            except OSError as exc:
                tally.errors += window
                log.debug("%s: %s", node_name(node.index), exc)
                continue
            finally:
                node.busy = False
            if head.startswith(b"HTTP/1.1 200"):
                node.delivered_s = now
                node.agent.answered(body, plan.datagrams)
                if window:
                    tally.ok += 1
                    tally.latencies_ms.append(took_ms)
            else:
                tally.errors += window
    finally:
        for connection in node.connections.values():
            if connection.transport is not None:
                connection.transport.close()


async def generate_async(plan: Plan, indices: Sequence[int], stop: Event) -> Tally:
    tally = Tally(array.array("d"), array.array("d"), array.array("d"))
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)  # a burst of acknowledgements is not dropped
    sock.bind((plan.host, 0))
    sock.setblocking(False)
    udp = Acknowledgements(sock, tally)
    loop.add_reader(sock.fileno(), udp.readable)
    signer = Signer(liveness_key(TOKEN))
    nodes = [Node(i, plan) for i in indices]
    tasks = [asyncio.create_task(drive(node, plan, tally)) for node in nodes]
    try:
        await pace(plan, nodes, stop, tally, udp, signer)
        deadline = time.monotonic() + STOP_WAIT_S
        while any(node.busy for node in nodes) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # the replies under way
        await asyncio.sleep(0.5)  # and the last acknowledgements
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        loop.remove_reader(sock.fileno())
        sock.close()
    return tally


def generate(plan: Plan, part: int, parts: int, stop: Event, results: Any) -> None:
    """A load generator process: the nodes ``part::parts``."""
    t = uvloop.run(generate_async(plan, range(part, plan.nodes, parts), stop))
    lost = sum(1 for _, window in t.pending.values() if window)
    results.put(
        (
            part,
            t.latencies_ms.tobytes(),
            t.datagram_ms.tobytes(),
            t.lag_ms.tobytes(),
            t.ok,
            t.errors,
            t.late,
            t.silent_last_s,
            t.datagrams,
            lost,
        )
    )
