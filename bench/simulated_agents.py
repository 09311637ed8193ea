"""The simulated agents of ``bench.controller_scale``: each node's heartbeat a second, as ``opsd agent`` sends it
(``opsd.protocol.heartbeat``), on a keep-alive connection of its own, from asyncio load-generator processes.

A heartbeat: the node's ranks with their step advancing every ``STEP_S``, ``step_s``, ``compute_s``, the running
sums ``steps_total`` and ``compute_total_s``, checkpoints so far, mesh coordinates (tp=8, pp=16, dp for the rest),
one node summary, and the node's collective time by phase, dimension and op (18 rows, for the flame graph); one
rank computes 1.3x slower than its peers.
"""

from __future__ import annotations

import array
import asyncio
import logging
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.synchronize import Event
from typing import Any

from opsd.protocol.heartbeat import VERSION, CommRow, Heartbeat, HeartbeatRank, encode

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
    silent_s: float  # the silent node sends nothing from then on

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
        self.tokens_per_s = 4096 * plan.nodes * plan.gpus_per_node / STEP_S

    def heartbeat(self, now_s: float) -> Heartbeat:
        elapsed = now_s - self.run_start_s
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
                )
            )
        summary = {"time_unix_s": now_s, "ranks": len(ranks), "step_s_max": step_s_max, "step_s_mean": STEP_S}
        comms: list[CommRow] = [  # the node's collective time by phase, dimension and op, cumulative (18 rows)
            (RUN, phase, dim, op, step * share * STEP_S * len(ranks), step, step << 20)
            for phase, dim, op, share in COMMS
        ]
        return Heartbeat(
            v=VERSION,
            node=self.name,
            time_unix_s=now_s,
            ranks=ranks,
            summaries=[{**summary, "mfu_ratio_mean": 0.41}],
            comms=comms,
        )

    def request(self, now_s: float) -> bytes:
        body = encode(self.heartbeat(now_s))
        return (self.head % len(body)).encode() + body


@dataclass
class Tally:
    latencies_ms: array.array[float]
    ok: int = 0  # answered 200 within the window
    errors: int = 0
    late: int = 0  # heartbeats sent more than 0.5 s after their time (the previous one took that long)
    silent_last_s: float = 0.0  # when the silent node sent its last heartbeat


async def drive(index: int, plan: Plan, stop: Event, tally: Tally) -> None:
    """One agent: a heartbeat a second at its phase, on a keep-alive connection (opened again after an error),
    until ``stop``."""
    agent = SimulatedAgent(index, plan, plan.start_s - 3600.0)
    begin, end = plan.window_s
    due = plan.start_s + index / plan.nodes
    streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
    try:
        while not stop.is_set():
            now = time.time()
            if due > now:
                await asyncio.sleep(due - now)
                now = time.time()
            if index == plan.silent_node and now >= plan.silent_s:
                return
            if now - due > 0.5:
                tally.late += begin <= now < end
                due = now  # no burst to catch up: the next one a second after this one
            due += 1.0
            try:
                if streams is None:
                    streams = await asyncio.open_connection(plan.host, plan.port)
                reader, writer = streams
                data = agent.request(now)
                sent = time.perf_counter()
                writer.write(data)
                head = await reader.readuntil(b"\r\n\r\n")
                found = _LENGTH.search(head)
                if found:
                    await reader.readexactly(int(found.group(1)))
                took_ms = (time.perf_counter() - sent) * 1000.0
            except (OSError, asyncio.IncompleteReadError) as exc:
                tally.errors += begin <= now < end
                log.debug("%s: %s", node_name(index), exc)
                if streams is not None:
                    streams[1].close()
                streams = None
                continue
            if index == plan.silent_node:
                tally.silent_last_s = now
            if begin <= now < end:
                if head.startswith(b"HTTP/1.1 200"):
                    tally.ok += 1
                    tally.latencies_ms.append(took_ms)
                else:
                    tally.errors += 1
    finally:
        if streams is not None:
            streams[1].close()


async def generate_async(plan: Plan, indices: Sequence[int], stop: Event) -> Tally:
    tally = Tally(array.array("d"))
    await asyncio.gather(*(drive(i, plan, stop, tally) for i in indices))
    return tally


def generate(plan: Plan, part: int, parts: int, stop: Event, results: Any) -> None:
    """A load generator process: the nodes ``part::parts``."""
    tally = asyncio.run(generate_async(plan, range(part, plan.nodes, parts), stop))
    results.put((part, tally.latencies_ms.tobytes(), tally.ok, tally.errors, tally.late, tally.silent_last_s))
