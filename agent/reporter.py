"""Heartbeats from the agent to the controller, and the controller's policy back to the ranks.

About every ``interval_s`` the agent POSTs one JSON heartbeat (``docs/protocol.md``, "agent -> controller") with
the node's identity, the ranks it has heard from and their last step, the GPU health events the controller has
not acknowledged, the summaries buffered since the last delivery, and each run's collective totals on the node
(cumulative, by phase, dimension and op: the controller's flame graph), with ``Authorization: Bearer <token>``.

- Failures (connection refused, timeout, non-2xx) are retried at the next tick after an exponential backoff with
  jitter (``backoff_s``), capped at ``max_backoff_s``.
- The buffer is bounded: summaries beyond ``max_summaries`` are dropped oldest first (and counted); health events
  are never dropped, they are resent until the controller acknowledges them (``ack_events_up_to``).
- The reply may carry a policy (checkpoint cadence, commands): it is written atomically to ``policy_path``, where
  the ranks' hooks read it (``trainer_hooks.policy_reader``).
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agent.health import GpuHealth
from agent.state import NodeState, RankSnapshot
from opsd.protocol.heartbeat import (
    VERSION,
    Heartbeat,
    HeartbeatEvent,
    HeartbeatFt,
    HeartbeatPipeline,
    HeartbeatRank,
    HeartbeatTimeout,
    encode,
)
from opsd.protocol.wire import StepReport, pipeline_bubble_ratio

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReporterConfig:
    url: str  # the controller's heartbeat endpoint, e.g. http://opsd:8080/v1/heartbeat
    token: str = ""
    interval_s: float = 1.0
    timeout_s: float = 5.0
    max_summaries: int = 300
    max_backoff_s: float = 30.0
    policy_path: str | None = None

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
        self.summaries: deque[dict[str, Any]] = deque()
        self.summaries_dropped = 0
        self.sent_ok = 0
        self.sent_failed = 0
        self.failures = 0  # consecutive
        self.last_policy: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- building ----------------------------------------------------------------------------------------------
    def summarise(self, now_s: float) -> None:
        """Buffer a summary of the node now (oldest dropped beyond ``max_summaries``)."""
        ranks = self.state.snapshot()
        steps = [r.last.step_s for r in ranks]
        mfu = [r.last.mfu_ratio for r in ranks]
        self.summaries.append(
            {
                "time_unix_s": now_s,
                "ranks": len(ranks),
                "step_s_max": max(steps, default=0.0),
                "step_s_mean": sum(steps) / len(steps) if steps else 0.0,
                "mfu_ratio_mean": sum(mfu) / len(mfu) if mfu else 0.0,
            }
        )
        while len(self.summaries) > self.config.max_summaries:
            self.summaries.popleft()
            self.summaries_dropped += 1

    def heartbeat(self, now_s: float) -> Heartbeat:
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
            )
            for r in self.state.snapshot()
        ]
        events = [HeartbeatEvent(**asdict(e)) for e in self.gpu.pending_events()] if self.gpu else []
        timeouts = [
            HeartbeatTimeout(
                run=t.run, rank=t.rank, step=t.step, time_unix_s=t.time_unix_s, dim=t.dim, op=t.op, waited_s=t.waited_s
            )
            for t in self.state.timeouts()
        ]
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

    # -- sending -----------------------------------------------------------------------------------------------
    def send_once(self, now_s: float) -> bool:
        """Summarise, send one heartbeat, apply the reply; whether it was delivered."""
        self.summarise(now_s)
        body = self.heartbeat(now_s)
        sent_summaries = len(body.summaries)
        request = urllib.request.Request(
            self.config.url,
            data=encode(body),
            method="POST",
            headers={"Content-Type": "application/json"}
            | ({"Authorization": f"Bearer {self.config.token}"} if self.config.token else {}),
        )
        try:
            with urllib.request.urlopen(request, timeout=self.config.timeout_s) as response:
                reply = json.loads(response.read() or b"{}")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            self.failures += 1
            self.sent_failed += 1
            log.warning("heartbeat to %s failed (%d in a row): %s", self.config.url, self.failures, exc)
            return False
        self.failures = 0
        self.sent_ok += 1
        for _ in range(min(sent_summaries, len(self.summaries))):
            self.summaries.popleft()
        self._apply(reply if isinstance(reply, dict) else {})
        return True

    def _apply(self, reply: dict[str, Any]) -> None:
        ack = reply.get("ack_events_up_to")
        if self.gpu is not None and isinstance(ack, int) and not isinstance(ack, bool):
            self.gpu.acknowledge(ack)
        policy = reply.get("policy")
        if isinstance(policy, dict) and policy != self.last_policy:
            self.last_policy = policy
            if self.config.policy_path:
                write_policy(self.config.policy_path, policy)
                log.info("policy from the controller written to %s: %s", self.config.policy_path, policy)

    def start(self) -> None:
        def loop() -> None:
            delay = 0.0
            while not self._stop.wait(delay):
                self.send_once(time.time())
                delay = backoff_s(self.failures, self.config.interval_s, self.config.max_backoff_s, random.random())

        self._thread = threading.Thread(target=loop, name="opsd-agent-reporter", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.config.timeout_s + 2)


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


def write_policy(path: str | Path, policy: dict[str, Any]) -> None:
    """Write the policy file atomically (a reader sees the old file or the new one, never a part)."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"v": 1, **policy}))
    os.replace(tmp, target)
