"""The agent's Prometheus metrics, rendered from ``NodeState`` at each scrape (every one is in docs/metrics.md).

Rendering at scrape time keeps ingest cheap (a datagram updates plain Python totals, not metric objects) and
makes forgetting a stale rank remove its series.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from opsd.protocol.mesh import DIM_NAMES as MESH_DIMENSIONS
from opsd.protocol.wire import REASONS, pipeline_bubble_ratio
from opsd_agent.flight import FlightUploader
from opsd_agent.rank_gate import DATAGRAM_REFUSALS
from opsd_agent.reporter import Reporter
from opsd_agent.state import NodeState, RankSnapshot

RANK = ["run", "rank"]
COMM = [*RANK, "dimension", "op"]

# report field -> (metric name, help)
_LAST_STEP_GAUGES = {
    "step_s": ("opsd_step_seconds", "Duration of the rank's last step."),
    "compute_s": ("opsd_step_compute_seconds", "Last step's time not blocked in collectives (step - exposed)."),
    "exposed_comm_s": ("opsd_step_exposed_comm_seconds", "Last step's time blocked waiting for collectives."),
    "overlapped_comm_s": ("opsd_step_overlapped_comm_seconds", "Last step's collective time that did not block."),
    "tokens_per_s": ("opsd_tokens_per_second", "Tokens per second of the rank's data-parallel shard, last step."),
    "job_tokens_per_s": ("opsd_job_tokens_per_second", "Tokens per second of the whole job, seen from the rank."),
    "mfu_ratio": ("opsd_mfu_ratio", "Model FLOPs utilisation of the job seen from the rank, last step (0-1)."),
}


class AgentStats:
    """The agent's own counters: datagrams received, rejected by reason."""

    def __init__(self) -> None:
        self.received = 0
        self.rejected = dict.fromkeys(REASONS + DATAGRAM_REFUSALS, 0)
        self._lock = threading.Lock()

    def count(self, reason: str | None) -> None:
        with self._lock:
            self.received += 1
            if reason is not None:
                self.rejected[reason] = self.rejected.get(reason, 0) + 1


#: a rank quiet for this many of its own steps (and ``quiet_after_s``) leaves /metrics until it reports again
QUIET_STEPS = 10


def audible(ranks: Iterable[RankSnapshot], now_s: float, quiet_after_s: float) -> list[RankSnapshot]:
    """The ranks heard from within ``quiet_after_s`` and ``QUIET_STEPS`` of their own step time: the others (a node's
    ranks after it left its run, ranks that exited) would stay on the dashboards as flat lines beside their
    replacements until they are forgotten (``stale_after_s``)."""
    return [r for r in ranks if now_s - r.last_seen_s <= max(quiet_after_s, QUIET_STEPS * r.last.step_s)]


class AgentCollector(Collector):
    def __init__(
        self,
        state: NodeState,
        stats: AgentStats,
        node: str,
        quiet_after_s: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.state = state
        self.stats = stats
        self.node = node
        self.quiet_after_s = quiet_after_s
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        now_s = self.clock()
        ranks = audible(self.state.snapshot(), now_s, self.quiet_after_s)
        yield from _rank_metrics(ranks)
        activity = GaugeMetricFamily(
            "opsd_rank_activity_seconds",
            "How long the rank has said it does this instead of stepping (a checkpoint it waits for, its end).",
            labels=[*RANK, "activity"],
        )
        heard = {(r.run, r.rank) for r in ranks}
        for (run, rank), (what, since_s) in sorted(self.state.activities().items()):
            if (run, rank) in heard:
                activity.add_metric([run, str(rank), what], max(0.0, now_s - since_s))
        yield activity
        received = CounterMetricFamily("opsd_agent_datagrams", "Datagrams received from ranks.", labels=["node"])
        received.add_metric([self.node], self.stats.received)
        yield received
        rejected = CounterMetricFamily(
            "opsd_agent_datagrams_rejected",
            "Datagrams dropped as malformed, by the rule they broke.",
            labels=["node", "reason"],
        )
        for reason, n in sorted(self.stats.rejected.items()):
            rejected.add_metric([self.node, reason], n)
        yield rejected
        seen = GaugeMetricFamily("opsd_agent_ranks", "Ranks this agent has heard from recently.", labels=["node"])
        seen.add_metric([self.node], len(ranks))
        yield seen


def _rank_metrics(ranks: Iterable[RankSnapshot]) -> Iterator[Metric]:
    ranks = list(ranks)
    info = GaugeMetricFamily(
        "opsd_rank_info",
        "Where a rank is: host and mesh coordinates (value 1).",
        labels=[*RANK, "host", *MESH_DIMENSIONS],
    )
    gauges = {f: GaugeMetricFamily(name, text, labels=RANK) for f, (name, text) in _LAST_STEP_GAUGES.items()}
    loss = GaugeMetricFamily("opsd_loss", "Training loss of the rank's last step (when it reported one).", labels=RANK)
    quorum = GaugeMetricFamily(
        "opsd_ft_quorum_replica_groups",
        "Replica groups in the quorum of the rank's last step (ranks of fault-tolerant replica groups).",
        labels=RANK,
    )
    healing = CounterMetricFamily(
        "opsd_ft_healing_seconds",
        "Seconds the rank spent healing from a live peer (fetching and loading its state).",
        labels=RANK,
    )
    bubble = GaugeMetricFamily(
        "opsd_pipeline_bubble_ratio",
        "Fraction of the rank's last step spent waiting on the neighbour pipeline stages (0-1; pipeline ranks).",
        labels=RANK,
    )
    memory = GaugeMetricFamily("opsd_memory_bytes", "Memory of the rank's last step, by kind.", labels=[*RANK, "kind"])
    seen = GaugeMetricFamily(
        "opsd_rank_last_report_timestamp_seconds", "When the agent last heard from the rank.", labels=RANK
    )
    steps = CounterMetricFamily("opsd_steps", "Steps reported by the rank.", labels=RANK)
    tokens = CounterMetricFamily("opsd_tokens", "Tokens trained by the rank's data-parallel shard.", labels=RANK)
    dropped = CounterMetricFamily("opsd_rank_dropped_reports", "Reports the rank could not deliver.", labels=RANK)
    errors = CounterMetricFamily("opsd_rank_internal_errors", "Failures inside the rank's monitor.", labels=RANK)
    skipped = CounterMetricFamily(
        "opsd_checkpoints_skipped",
        "Checkpoint saves the rank skipped because its previous one was still being written.",
        labels=RANK,
    )
    fallbacks = CounterMetricFamily(
        "opsd_rank_comm_timing_fallbacks",
        "Process groups of the rank whose collectives are timed on the host: their GPU completion hook was refused.",
        labels=RANK,
    )
    host_timed = CounterMetricFamily(
        "opsd_rank_comm_host_timed_seconds",
        "Of the rank's seconds in collectives, those timed on the host (from the call's launch) on process groups "
        "whose GPU completion hook was refused.",
        labels=RANK,
    )
    comm_s = CounterMetricFamily("opsd_collective_seconds", "Time in collectives, issue to completion.", labels=COMM)
    comm_b = CounterMetricFamily("opsd_collective_bytes", "Bytes of collectives (full buffer).", labels=COMM)
    comm_n = CounterMetricFamily("opsd_collectives", "Collectives issued.", labels=COMM)
    ckpt_n = CounterMetricFamily("opsd_checkpoints", "Checkpoint saves finished by the rank.", labels=RANK)
    ckpt_s = CounterMetricFamily(
        "opsd_checkpoint_seconds",
        "Checkpoint time: blocking (training stopped), staging (part of blocking) and total.",
        labels=[*RANK, "phase"],
    )
    ckpt_b = CounterMetricFamily("opsd_checkpoint_bytes", "Checkpoint bytes written by the rank.", labels=RANK)

    for r in ranks:
        labels = [r.run, str(r.rank)]
        info.add_metric([*labels, r.host, *(str(r.coords.get(d, 0)) for d in MESH_DIMENSIONS)], 1)
        for f, gauge in gauges.items():
            gauge.add_metric(labels, float(getattr(r.last, f)))
        if r.last.loss is not None:
            loss.add_metric(labels, r.last.loss)
        ratio = pipeline_bubble_ratio(r.last)
        if ratio is not None:
            bubble.add_metric(labels, ratio)
        if r.last.ft is not None and r.ft is not None:
            quorum.add_metric(labels, r.last.ft.quorum_replicas)
            healing.add_metric(labels, r.ft.healing_s)
        for kind, value in sorted(r.last.memory.items()):
            memory.add_metric([*labels, kind.removesuffix("_bytes")], float(value))
        seen.add_metric(labels, r.last_seen_s)
        steps.add_metric(labels, r.steps_total)
        tokens.add_metric(labels, r.tokens_total)
        dropped.add_metric(labels, r.last.dropped_reports_total)
        errors.add_metric(labels, r.last.internal_errors_total)
        if r.last.checkpoints_skipped_total:
            skipped.add_metric(labels, r.last.checkpoints_skipped_total)
        if r.last.comm_timing_fallbacks_total:
            fallbacks.add_metric(labels, r.last.comm_timing_fallbacks_total)
        if r.comm_host_timed_s:
            host_timed.add_metric(labels, r.comm_host_timed_s)
        if r.checkpoints.count:
            c = r.checkpoints
            ckpt_n.add_metric(labels, c.count)
            ckpt_b.add_metric(labels, c.bytes)
            ckpt_s.add_metric([*labels, "blocking"], c.blocking_s)
            ckpt_s.add_metric([*labels, "staging"], c.staging_s)
            ckpt_s.add_metric([*labels, "total"], c.total_s)
        for (dim, op), totals in sorted(r.comms.items()):
            comm_s.add_metric([*labels, dim, op], totals.seconds)
            comm_b.add_metric([*labels, dim, op], totals.bytes)
            comm_n.add_metric([*labels, dim, op], totals.count)
    yield info
    yield from gauges.values()
    yield from (loss, bubble, quorum, healing, memory, seen, steps, tokens, dropped, errors, fallbacks, host_timed)
    yield from (comm_s, comm_b, comm_n, ckpt_n, ckpt_s, ckpt_b, skipped)


class ReporterCollector(Collector):
    """Heartbeats to the controller: delivered and failed, summaries dropped, events awaiting acknowledgement."""

    def __init__(self, reporter: Reporter, node: str) -> None:
        self.reporter = reporter
        self.node = node

    def collect(self) -> Iterator[Metric]:
        r = self.reporter
        sent = CounterMetricFamily("opsd_agent_heartbeats", "Heartbeats to the controller.", labels=["node", "result"])
        sent.add_metric([self.node, "ok"], r.sent_ok)
        sent.add_metric([self.node, "error"], r.sent_failed)
        yield sent
        refused = CounterMetricFamily(
            "opsd_agent_replies_refused",
            "Replies of the controller to heartbeats delivered that do not fit the protocol (nothing in them applied).",
            labels=["node"],
        )
        refused.add_metric([self.node], r.replies_refused)
        yield refused
        dropped = CounterMetricFamily(
            "opsd_agent_summaries_dropped",
            "Summaries dropped, oldest first, while the controller was unreachable.",
            labels=["node"],
        )
        dropped.add_metric([self.node], r.summaries_dropped)
        yield dropped
        pending = GaugeMetricFamily(
            "opsd_agent_pending_health_events",
            "GPU health events the controller has not acknowledged.",
            labels=["node"],
        )
        pending.add_metric([self.node], len(r.gpu.pending_events()) if r.gpu else 0)
        yield pending
        datagrams = CounterMetricFamily(
            "opsd_agent_liveness_datagrams",
            "Liveness datagrams to the controller: sent, acknowledged, or not sent (error).",
            labels=["node", "result"],
        )
        sender = r.liveness
        for result, n in zip(
            ("sent", "acknowledged", "error"),
            (sender.sent, sender.acknowledged, sender.errors) if sender else (0, 0, 0),
            strict=True,
        ):
            datagrams.add_metric([self.node, result], n)
        yield datagrams
        over_http = GaugeMetricFamily(
            "opsd_agent_liveness_over_http",
            "1 while the node's liveness goes over HTTP (the controller takes no datagrams, or none is acknowledged).",
            labels=["node"],
        )
        over_http.add_metric([self.node], 1.0 if r.over_http else 0.0)
        yield over_http
        interval = GaugeMetricFamily(
            "opsd_agent_telemetry_interval_seconds",
            "How often the ranks go to the controller, as it asks (the heartbeat interval when it does not say).",
            labels=["node"],
        )
        interval.add_metric([self.node], r.telemetry_interval_s or r.config.interval_s)
        yield interval


class FlightCollector(Collector):
    """Flight Recorder dumps sent to the controller, by result (``opsd_agent.flight``); zeros while no uploader runs
    (no ``--flight-dir`` or no ``--controller-url``)."""

    def __init__(self, uploader: Callable[[], FlightUploader | None], node: str) -> None:
        self.uploader = uploader
        self.node = node

    def collect(self) -> Iterator[Metric]:
        u = self.uploader()
        dumps = CounterMetricFamily(
            "opsd_agent_flight_dumps",
            "Flight Recorder dumps of the node's ranks: delivered (ok), failed attempts (error), skipped (too_large).",
            labels=["node", "result"],
        )
        counts = (u.ok, u.errors, u.too_large) if u is not None else (0, 0, 0)
        for result, n in zip(("ok", "error", "too_large"), counts, strict=True):
            dumps.add_metric([self.node, result], n)
        yield dumps
