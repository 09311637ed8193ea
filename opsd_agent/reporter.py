"""Heartbeats from the agent to the controller, and the controller's policy back to the ranks.

Every ``interval_s`` (a beat) the agent says it is alive, and now and then it POSTs one JSON heartbeat
(``docs/protocol.md``, "agent -> controller") with the node's identity, the ranks it has heard from and their last
step, the GPU health events the controller has not acknowledged, the summaries buffered since the last delivery, and
each run's collective totals on the node (cumulative, by phase, dimension and op: the controller's flame graph), with
``Authorization: Bearer <token>``, on a keep-alive connection (``opsd_agent.connection``).

- How often: every beat, as long as the controller's replies do not say otherwise (an older controller). A reply
  that names ``telemetry_interval_s`` and ``liveness_port`` asks for the ranks every ``telemetry_interval_s`` (and at
  once when a GPU event or a collective timeout is new), and for a signed liveness datagram every beat
  (``opsd_agent.liveness``); while the datagrams go unacknowledged, or without a port, the beats in between are
  heartbeats without ranks over HTTP (liveness only).
- Where: to ``url``, the API, until a reply names a ``heartbeat_port``: from then on to that port of the same host
  (the controller's heartbeat process: same scheme, path and token), but for a heartbeat with GPU events, one that
  process sends back (421: only the API answers it) and, for ``APART_HOLD_S`` after that process could not be
  reached, every heartbeat.
- Failures (connection refused, timeout, non-2xx) are retried after an exponential backoff with jitter
  (``backoff_s``), capped at ``max_backoff_s``; the datagrams go on every beat meanwhile.
- The buffer is bounded: summaries beyond ``max_summaries`` are dropped oldest first (and counted); health events
  are never dropped, they are resent until the controller acknowledges them (``ack_events_up_to``).
- The reply may carry a policy (checkpoint cadence, commands): it is written atomically to ``policy_path``, where
  the ranks' hooks read it (``trainer_hooks.policy_reader``).
"""

from __future__ import annotations

import http.client
import logging
import math
import os
import random
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from opsd.errors import BodyError
from opsd.policy.telemetry import phase_ratio, ranks_due
from opsd.protocol.heartbeat import (
    SEND_TO_API,
    VERSION,
    Heartbeat,
    HeartbeatFt,
    HeartbeatPipeline,
    HeartbeatRank,
    HeartbeatReply,
    NodeSummary,
    decode_reply,
    encode,
)
from opsd.protocol.policy_file import Policy, encode_policy
from opsd.protocol.wire import StepReport, pipeline_bubble_ratio
from opsd_agent.connection import Connection
from opsd_agent.health import GpuHealth
from opsd_agent.liveness import LivenessSender
from opsd_agent.state import NodeState, RankSnapshot

log = logging.getLogger(__name__)
#: what a delivered heartbeat whose reply does not fit the protocol stands for: nothing in it is applied
NO_REPLY = HeartbeatReply(ack_events_up_to=-1)

APART_HOLD_S = 60.0  # after the heartbeat process could not be reached: heartbeats to the API this long


@dataclass(frozen=True)
class ReporterConfig:
    url: str  # the controller's heartbeat endpoint, e.g. http://opsd:8080/v1/heartbeat
    token: str = ""
    interval_s: float = 1.0
    timeout_s: float = 5.0
    max_summaries: int = 300
    max_backoff_s: float = 30.0
    policy_path: str | None = None
    datagrams: bool = True  # liveness by datagram when the controller offers a port (else over HTTP)

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError("reporter.url must be an http:// or https:// URL")
        if self.interval_s <= 0:
            raise ValueError("reporter.interval_s must be > 0")
        if self.timeout_s <= 0:
            raise ValueError("reporter.timeout_s must be > 0")
        if self.max_summaries < 1:
            raise ValueError("reporter.max_summaries must be >= 1")
        if self.max_backoff_s < self.interval_s:
            raise ValueError("reporter.max_backoff_s must be >= interval_s")


def backoff_s(failures: int, interval_s: float, cap_s: float, jitter_ratio: float) -> float:
    """Delay before the next attempt after ``failures`` consecutive failures: the interval doubled per failure,
    capped, times a jitter factor in [1 - ratio/2, 1 + ratio/2] (``jitter_ratio`` drawn by the caller in [0, 1])."""
    if failures <= 0:
        return interval_s
    base = min(interval_s * 2.0 ** min(failures, 30), cap_s)
    return min(base * (0.5 + jitter_ratio), cap_s)


class Reporter:
    def __init__(self, config: ReporterConfig, node: str, state: NodeState, gpu: GpuHealth | None) -> None:
        self.config = config
        self.node = node
        self.state = state
        self.gpu = gpu
        self.summaries: deque[NodeSummary] = deque()
        self.summaries_dropped = 0
        self.sent_ok = 0
        self.sent_failed = 0
        self.failures = 0  # consecutive
        self.last_policy: Policy | None = None
        self.replies_refused = 0  # replies delivered that do not fit the protocol (nothing in them taken)
        self.connection = Connection(config.url, config.timeout_s)
        self.apart: Connection | None = None  # to the controller's heartbeat process, while its replies name one
        self.apart_hold_mono_s = -math.inf  # it could not be reached: not tried again before then (monotonic)
        self.telemetry_interval_s: float | None = None  # as the controller asks (None: it does not: every beat)
        self.liveness: LivenessSender | None = None  # while the controller offers a datagram port
        self.over_http = True  # the liveness goes over HTTP (no port, datagrams off, or unacknowledged)
        self.delivered_s = -math.inf  # the last heartbeat with the ranks delivered
        self.phase_ratio = phase_ratio(node)  # where in each interval it sends the ranks (opsd.policy.telemetry)
        self.events_sent_up_to = 0  # the newest GPU event delivered
        self.timeouts_sent: set[tuple[str, int, int]] = set()  # collective timeouts delivered (run, rank, step)
        self.retry_mono_s = 0.0  # after a failure: no heartbeat before then (monotonic)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- building ----------------------------------------------------------------------------------------------
    def summarise(self, now_s: float) -> None:
        """Buffer a summary of the node now (oldest dropped beyond ``max_summaries``)."""
        ranks = self.state.snapshot()
        steps = [r.last.step_s for r in ranks]
        mfu = [r.last.mfu_ratio for r in ranks]
        self.summaries.append(
            NodeSummary(
                time_unix_s=now_s,
                ranks=len(ranks),
                step_s_max=max(steps, default=0.0),
                step_s_mean=sum(steps) / len(steps) if steps else 0.0,
                mfu_ratio_mean=sum(mfu) / len(mfu) if mfu else 0.0,
            )
        )
        while len(self.summaries) > self.config.max_summaries:
            self.summaries.popleft()
            self.summaries_dropped += 1

    def heartbeat(self, now_s: float) -> Heartbeat:
        activities = self.state.activities()
        ranks = [
            HeartbeatRank(
                run=r.run,
                rank=r.rank,
                host=r.host,
                step=r.last.step,
                step_s=r.last.step_s,
                compute_s=r.last.compute_s,
                steps_total=r.steps_total,
                compute_total_s=r.compute_total_s,
                mfu_ratio=r.last.mfu_ratio,
                job_tokens_per_s=r.last.job_tokens_per_s,
                checkpoints=r.checkpoints.count,
                checkpoint_blocking_s=r.checkpoints.blocking_s,
                checkpoint_total_s=r.checkpoints.total_s,
                last_report_unix_s=r.last_seen_s,
                coords=r.coords,
                resumed_from_step=r.last.resumed_from_step,
                pipeline=_pipeline(r.last),
                launch=r.last.launch,
                ft=_ft(r),
                world_size=r.last.world_size,
                activity=activity,
                activity_s=max(0.0, now_s - since_s),
            )
            for r in self.state.snapshot()
            for activity, since_s in (activities.get((r.run, r.rank), ("", now_s)),)
        ]
        events = self.gpu.pending_events() if self.gpu else []
        timeouts = [t.wait() for t in self.state.timeouts()]
        return Heartbeat(
            v=VERSION,
            node=self.node,
            time_unix_s=now_s,
            ranks=ranks,
            events=events,
            timeouts=timeouts,
            summaries=list(self.summaries),
            summaries_dropped_total=self.summaries_dropped,
            comms=[(c.run, c.phase, c.dimension, c.op, c.seconds, c.count, c.bytes) for c in self.state.run_comms()],
        )

    # -- sending ---------------------------------------------------------------------------------------------
    def beat(self, now_s: float, mono_s: float | None = None) -> None:
        """One beat: a liveness datagram when the controller offers a port, and the heartbeat due: with the ranks
        when their interval is up (or something new must go at once), else one without them when the liveness goes
        over HTTP. After a failure, no heartbeat until its backoff is over."""
        mono_s = time.monotonic() if mono_s is None else mono_s
        sender = self.liveness
        if sender is not None:
            sender.receive()
            self.over_http = sender.lost(mono_s)
            sender.send(now_s, mono_s)
        if self.failures and mono_s < self.retry_mono_s:
            return
        if self.ranks_due(now_s):
            ok = self.send_once(now_s)
        elif sender is None or self.over_http:
            ok = self.send_liveness(now_s)
        else:
            return
        if not ok:
            jitter = random.random()
            self.retry_mono_s = mono_s + backoff_s(
                self.failures, self.config.interval_s, self.config.max_backoff_s, jitter
            )

    def ranks_due(self, now_s: float) -> bool:
        """Whether the next heartbeat carries the ranks: every beat unless the controller asked for an interval
        (and on each attempt after a failure); else once its slot of the interval has begun since the last delivered
        (``opsd.policy.telemetry.ranks_due``), or a GPU event or a collective timeout is new."""
        interval_s = self.telemetry_interval_s
        if interval_s is None or self.failures:
            return True
        if ranks_due(now_s=now_s, delivered_s=self.delivered_s, interval_s=interval_s, phase_ratio=self.phase_ratio):
            return True
        events = self.gpu.pending_events() if self.gpu is not None else []
        if any(e.seq > self.events_sent_up_to for e in events):
            return True
        return any((t.run, t.rank, t.step) not in self.timeouts_sent for t in self.state.timeouts())

    def send_once(self, now_s: float) -> bool:
        """Summarise, send one heartbeat with the ranks, apply the reply; whether it was delivered."""
        self.summarise(now_s)
        body = self.heartbeat(now_s)
        reply = self._post(encode(body), to_api=bool(body.events))
        if reply is None:
            return False
        for _ in range(min(len(body.summaries), len(self.summaries))):
            self.summaries.popleft()
        self.delivered_s = now_s
        self.events_sent_up_to = max([self.events_sent_up_to, *(e.seq for e in body.events)])
        self.timeouts_sent = {(t.run, t.rank, t.step) for t in body.timeouts}
        self._apply(reply)
        return True

    def send_liveness(self, now_s: float) -> bool:
        """Send a heartbeat without the ranks (liveness only), apply the reply; whether it was delivered."""
        reply = self._post(encode(Heartbeat(v=VERSION, node=self.node, time_unix_s=now_s)))
        if reply is None:
            return False
        self._apply(reply)
        return True

    def _post(self, data: bytes, *, to_api: bool = False) -> HeartbeatReply | None:
        """POST a heartbeat (``to_api``: to the API, not its heartbeat process); the reply (None: not delivered,
        counted)."""
        headers = {"Content-Type": "application/json"}
        if self.config.token:
            headers["Authorization"] = f"Bearer {self.config.token}"
        try:
            status, answer = self._send(data, headers, to_api)
            if not 200 <= status < 300:
                raise ValueError(f"HTTP {status}: {answer[:200]!r}")
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self.failures += 1
            self.sent_failed += 1
            log.warning("heartbeat to %s failed (%d in a row): %s", self.config.url, self.failures, exc)
            return None
        self.failures = 0
        self.sent_ok += 1
        try:
            return decode_reply(answer)
        except BodyError as exc:  # delivered, but nothing in it is taken
            self.replies_refused += 1
            log.warning("the controller's reply to a heartbeat does not fit docs/protocol.md, ignored: %s", exc)
            return NO_REPLY

    def _send(self, data: bytes, headers: dict[str, str], to_api: bool) -> tuple[int, bytes]:
        """To the heartbeat process when there is one; to the API when it sends the heartbeat back (421), or cannot
        be reached (then not tried again for ``APART_HOLD_S``)."""
        apart = self.apart
        if apart is not None and not to_api and time.monotonic() >= self.apart_hold_mono_s:
            try:
                status, answer = apart.post(data, headers)
            except (OSError, http.client.HTTPException) as exc:
                self.apart_hold_mono_s = time.monotonic() + APART_HOLD_S
                log.warning("the controller's heartbeat process at port %d: %s; to the API for now", apart.port, exc)
            else:
                if status != SEND_TO_API:
                    return status, answer
        return self.connection.post(data, headers)

    def _apply(self, reply: HeartbeatReply) -> None:
        if reply is NO_REPLY:  # delivered, but not understood: nothing changes
            return
        if self.gpu is not None:
            self.gpu.acknowledge(reply.ack_events_up_to)
        policy = reply.policy
        if policy is not None and policy != self.last_policy:
            self.last_policy = policy
            if self.config.policy_path:
                write_policy(self.config.policy_path, policy)
                log.info("policy from the controller written to %s: %s", self.config.policy_path, policy)
        interval = reply.telemetry_interval_s
        if interval is not None and interval < math.inf:
            interval_s = max(interval, self.config.interval_s)
            if interval_s != self.telemetry_interval_s:
                log.info("the controller asks for the ranks every %g s", interval_s)
            self.telemetry_interval_s = interval_s
        else:
            self.telemetry_interval_s = None  # an older controller: everything every beat
        self._liveness(reply.liveness_port)
        self._apart(reply.heartbeat_port)

    def _apart(self, port: int | None) -> None:
        """Heartbeats to ``port`` of the controller's host from now on (None: to the API)."""
        if self.apart is not None and port != self.apart.port:
            self.apart.close()
            self.apart = None
        if port is not None and self.apart is None:
            self.apart = Connection(with_port(self.config.url, port), self.config.timeout_s)
            self.apart_hold_mono_s = -math.inf  # another process (a new leader's): tried at once
            log.info("heartbeats to the controller's heartbeat process at port %d", port)

    def _liveness(self, port: int | None) -> None:
        """Datagrams to ``port`` of the controller's host from now on (None: none)."""
        if self.liveness is not None and (port is None or port != self.liveness.port):
            self.liveness.close()
            self.liveness = None
            self.over_http = True
        if port is None or self.liveness is not None or not self.config.datagrams or not self.config.token:
            return
        host = urlsplit(self.config.url).hostname or ""
        try:
            self.liveness = LivenessSender(self.node, self.config.token, host, port, 2 * self.config.interval_s)
        except OSError as exc:  # the name does not resolve for UDP: liveness over HTTP, tried again next reply
            log.warning("no liveness datagrams to %s:%d: %s", host, port, exc)
            return
        self.over_http = False
        log.info("liveness datagrams to %s:%d every %g s", host, port, self.config.interval_s)

    def start(self) -> None:
        def loop() -> None:
            next_mono = time.monotonic()
            while not self._stop.wait(max(0.0, next_mono - time.monotonic())):
                next_mono += self.config.interval_s
                self.beat(time.time())
                next_mono = max(next_mono, time.monotonic())  # no burst to catch up after a slow beat

        self._thread = threading.Thread(target=loop, name="opsd-agent-reporter", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.config.timeout_s + 2)
        self.connection.close()
        if self.apart is not None:
            self.apart.close()
        if self.liveness is not None:
            self.liveness.close()


def with_port(url: str, port: int) -> str:
    """``url`` at another port of its host (``https://opsd:8470/v1/heartbeat``, 8471 ->
    ``https://opsd:8471/v1/heartbeat``)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    return parts._replace(netloc=f"{host}:{port}").geturl()


def _pipeline(report: StepReport) -> HeartbeatPipeline | None:
    """What the controller needs of a pipeline stage's last step: its bubble ratio and its schedule."""
    ratio, p = pipeline_bubble_ratio(report), report.pipeline
    if ratio is None or p is None:
        return None
    return HeartbeatPipeline(bubble_ratio=ratio, schedule=p.schedule, stages=p.stages, microbatches=p.microbatches)


def _ft(rank: RankSnapshot) -> HeartbeatFt | None:
    """What the controller needs of a fault-tolerant replica group's rank: its last quorum and its sums."""
    q, f = rank.last.ft, rank.ft
    if q is None or f is None:
        return None
    return HeartbeatFt(
        replica_group=q.replica_group,
        replica_groups=q.replica_groups,
        quorum_id=q.quorum_id,
        quorum_replicas=q.quorum_replicas,
        participants=q.participants,
        committed=q.committed,
        heals=f.heals,
        healing_total_s=f.healing_s,
        quorum_wait_total_s=f.quorum_wait_s,
        discarded_steps=f.discarded_steps,
    )


def write_policy(path: str | Path, policy: Policy) -> None:
    """Write the policy file atomically (a reader sees the old file or the new one, never a part)."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_bytes(encode_policy(policy))
    os.replace(tmp, target)
