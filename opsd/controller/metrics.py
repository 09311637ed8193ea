"""The controller's ``/metrics``: run-level series computed at scrape time from its state (docs/metrics.md). A few
series per run, none per rank, except the ranks flagged as stragglers now (a handful at most)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from opsd.controller.controller import Controller
from opsd.controller.views import cadence_interval_s, recommended_spares, shared_pool
from opsd.protocol.answers import SharedPool
from opsd.protocol.states import NodeRole, RunState

# fine where recoveries are (a swap in seconds, a relaunch in tens of seconds): a quantile is interpolated within a
# bucket, and with 10 s and 30 s first a 9 s recovery read as 5 s, a 12 s one as 20 s
RECOVERY_BUCKETS_S = (2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)


#: why a liveness datagram is refused: by the API (``opsd.protocol.liveness.REASONS``), by the controller
DATAGRAM_REASONS = ("malformed", "version", "mac", "replay", "skew")


class ApiStats:
    """Requests the API refused, by reason, liveness datagrams refused, by reason, and what its heartbeat process
    answered."""

    def __init__(self) -> None:
        self.rejected: dict[str, int] = {}
        self.requests = 0
        self.datagrams_refused: dict[str, int] = {}
        self.heartbeats_apart = 0  # answered by the API's heartbeat process (opsd.api.heartbeat_worker)
        self.heartbeats_sent_to_api = 0  # that process's 421s: heartbeats only the API answers

    def reject(self, reason: str, count: int = 1) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + count

    def refuse_datagram(self, reason: str, count: int = 1) -> None:
        self.datagrams_refused[reason] = self.datagrams_refused.get(reason, 0) + count


#: why a request is refused: 401, 403, 422; and by the heartbeat process's server, 413 and 400 (``opsd.api.http1``)
REJECTED_REASONS = ("auth", "forbidden", "validation", "too_large", "malformed")


class ControllerCollector(Collector):
    def __init__(self, controller: Controller, stats: ApiStats, clock: Callable[[], float] = time.time) -> None:
        self.controller = controller
        self.stats = stats
        self.clock = clock

    def collect(self) -> Iterable[Metric]:
        now = self.clock()
        controller = self.controller
        run_labels = ["run"]
        gauges = {
            "mfu_ratio": GaugeMetricFamily(
                "opsd_run_mfu_ratio", "Job MFU (mean of the ranks' last steps).", labels=run_labels
            ),
            "tokens_per_s": GaugeMetricFamily(
                "opsd_run_tokens_per_second", "Job tokens per second.", labels=run_labels
            ),
            "step": GaugeMetricFamily("opsd_run_step", "The run's newest step.", labels=run_labels),
            "ettr": GaugeMetricFamily(
                "opsd_run_ettr_ratio", "Effective training time ratio so far.", labels=run_labels
            ),
            "spares_available": GaugeMetricFamily(
                "opsd_run_spares_available", "Healthy spare nodes of the run.", labels=run_labels
            ),
        }
        state = GaugeMetricFamily("opsd_run_state", "1 for the run's current state.", labels=["run", "state"])
        mtbf = GaugeMetricFamily("opsd_run_mtbf_seconds", "The run's MTBF estimate.", labels=run_labels)
        every = GaugeMetricFamily(
            "opsd_run_checkpoint_interval_steps", "Published checkpoint cadence.", labels=run_labels
        )
        every_s = GaugeMetricFamily(
            "opsd_run_checkpoint_interval_seconds", "Published checkpoint cadence in seconds.", labels=run_labels
        )
        cost = GaugeMetricFamily(
            "opsd_run_checkpoint_cost_seconds", "Mean seconds a checkpoint blocks training.", labels=run_labels
        )
        last_commit = GaugeMetricFamily(
            "opsd_run_checkpoint_last_commit_timestamp_seconds",
            "When every rank had finished the newest checkpoint (Unix time).",
            labels=run_labels,
        )
        progress = GaugeMetricFamily(
            "opsd_run_last_progress_timestamp_seconds", "When the run's newest step last advanced.", labels=run_labels
        )
        recommended = GaugeMetricFamily(
            "opsd_run_spares_recommended", "Recommended spare pool size.", labels=run_labels
        )
        stragglers = GaugeMetricFamily("opsd_run_stragglers", "Ranks flagged as stragglers now.", labels=run_labels)
        maintenance = GaugeMetricFamily(
            "opsd_run_maintenance",
            "1 while a maintenance window holds the run's recoveries (incidents are still recorded).",
            labels=run_labels,
        )
        agents_down = GaugeMetricFamily(
            "opsd_run_agents_down",
            "Nodes of the run whose agent is silent while their ranks train (an operations event, no recovery).",
            labels=run_labels,
        )
        slowdown = GaugeMetricFamily(
            "opsd_run_straggler_slowdown_ratio",
            "Compute time of a flagged rank over its peers' median.",
            labels=["run", "rank", "node"],
        )
        incidents = CounterMetricFamily("opsd_run_incidents", "Incidents by cause.", labels=["run", "cause"])
        bubble = GaugeMetricFamily(
            "opsd_run_pipeline_bubble_ratio",
            "Pipeline bubble: the mean over the ranks of their last step's time waiting on neighbour stages (0-1).",
            labels=run_labels,
        )
        theory = GaugeMetricFamily(
            "opsd_pipeline_bubble_theoretical_ratio",
            "Pipeline bubble of the run's schedule, stages and micro-batches by the formula (p - 1) / (m + p - 1).",
            labels=run_labels,
        )
        margin = GaugeMetricFamily(
            "opsd_pipeline_bubble_margin_ratio",
            "How far the measured bubble may exceed the theory before the alert (controller.pipeline.margin_ratio).",
            labels=run_labels,
        )
        replica_groups = GaugeMetricFamily(
            "opsd_run_replica_groups", "A fault-tolerant run's replica groups (as laid out).", labels=run_labels
        )
        quorum = GaugeMetricFamily(
            "opsd_run_quorum_replica_groups",
            "Replica groups in the newest quorum a fault-tolerant run's ranks reported.",
            labels=run_labels,
        )
        out = GaugeMetricFamily(
            "opsd_run_replica_groups_out",
            "A fault-tolerant run's replica groups out of service (being recovered, or waiting for a node).",
            labels=run_labels,
        )
        missed = CounterMetricFamily(
            "opsd_replica_group_missed_steps",
            "Steps the other replica groups made while this one was out, over its replica recoveries.",
            labels=["run", "group"],
        )
        recovery = HistogramMetricFamily(
            "opsd_run_recovery_seconds",
            "Detection to first productive step, per recovered incident.",
            labels=run_labels,
        )
        for run in controller.store.runs():
            run_id = run.id
            status = controller.status(run_id, now)
            if status is None:
                continue
            for key, family in gauges.items():
                family.add_metric([run_id], float(getattr(status, key) or 0.0))
            for name in RunState:
                state.add_metric([run_id, name], 1.0 if run.state == name else 0.0)
            if status.mtbf_s is not None:
                mtbf.add_metric([run_id], float(status.mtbf_s))
            if status.cadence is not None:
                every.add_metric([run_id], float(status.cadence.every_steps))
            seconds = cadence_interval_s(controller, run_id)
            if seconds is not None:
                every_s.add_metric([run_id], seconds)
            with controller.lock:
                live = controller.live_of(run_id)
                if live is not None and live.checkpoints:
                    cost.add_metric([run_id], live.checkpoint_blocking_s / live.checkpoints)
                memory = controller.memory.get(run_id)
                committed_s = memory.checkpointed_s if memory is not None else None
                progressed_s = memory.progressed_s if memory is not None else None
            if committed_s is not None:
                last_commit.add_metric([run_id], committed_s)
            progress.add_metric([run_id], progressed_s if progressed_s is not None else float(run.created_s))
            active = sum(1 for n in status.nodes if n.role == NodeRole.ACTIVE)
            run_incidents = controller.store.incidents(run_id)
            recommended.add_metric([run_id], recommended_spares(controller, run, active, now, run_incidents)[0])
            stragglers.add_metric([run_id], float(len(status.stragglers)))
            agents_down.add_metric([run_id], float(len(status.agents_down)))
            maintenance.add_metric([run_id], 0.0 if status.maintenance is None else 1.0)
            pipeline = status.pipeline
            if pipeline is not None:
                bubble.add_metric([run_id], pipeline.bubble_ratio)
                if pipeline.margin_ratio is not None:
                    margin.add_metric([run_id], pipeline.margin_ratio)
                if pipeline.theoretical_ratio is not None:
                    theory.add_metric([run_id], pipeline.theoretical_ratio)
            for s in status.stragglers:
                slowdown.add_metric([run_id, str(s.rank), s.node], float(s.slowdown_ratio))
            replicas = status.replicas
            if replicas is not None:
                replica_groups.add_metric([run_id], float(replicas.groups))
                out.add_metric([run_id], float(len(replicas.out)))
                if replicas.quorum_replica_groups is not None:
                    quorum.add_metric([run_id], float(replicas.quorum_replica_groups))
                for group in range(replicas.groups):
                    missed.add_metric([run_id, str(group)], float(replicas.missed_steps.get(str(group), 0)))
            causes: dict[str, int] = {}
            recovered: list[float] = []
            for i in run_incidents:
                causes[i.kind] = causes.get(i.kind, 0) + 1
                if i.resumed_s is not None:
                    recovered.append(float(i.resumed_s) - float(i.detected_s))
            for cause, n in sorted(causes.items()):
                incidents.add_metric([run_id, cause], n)
            buckets = [(_le(b), float(sum(1 for r in recovered if r <= b))) for b in RECOVERY_BUCKETS_S]
            buckets.append(("+Inf", float(len(recovered))))
            recovery.add_metric([run_id], buckets, math.fsum(recovered))
        yield from pool_metrics(shared_pool(controller, now))
        yield from gauges.values()
        yield from (state, mtbf, every, every_s, cost, last_commit, progress, recommended, stragglers, slowdown)
        yield from (agents_down, maintenance)
        yield from (bubble, theory, margin, incidents, recovery, replica_groups, quorum, out, missed)
        yield CounterMetricFamily("opsd_controller_heartbeats", "Heartbeats taken.", value=controller.heartbeats_total)
        yield CounterMetricFamily(
            "opsd_controller_deferred",
            "Heartbeats (and first contacts) the API's event loop left to the controller lock's next holder.",
            value=controller.deferred_total,
        )
        yield CounterMetricFamily(
            "opsd_controller_heartbeats_apart",
            "Heartbeats answered by the API's heartbeat process (counted in opsd_controller_heartbeats_total too).",
            value=self.stats.heartbeats_apart,
        )
        yield CounterMetricFamily(
            "opsd_controller_heartbeats_sent_to_api",
            "Heartbeats the API's heartbeat process sent to the API (421): a new node or run, GPU events.",
            value=self.stats.heartbeats_sent_to_api,
        )
        yield from liveness_metrics(controller, self.stats, now)
        rejected = CounterMetricFamily(
            "opsd_controller_rejected_requests", "Requests refused, by reason.", labels=["reason"]
        )
        for reason in REJECTED_REASONS:
            rejected.add_metric([reason], self.stats.rejected.get(reason, 0))
        yield rejected
        errors = CounterMetricFamily(
            "opsd_controller_trace_errors",
            "Incident traces that could not be built, span exports that failed.",
            labels=["stage"],
        )
        for stage, n in sorted(dict(controller.tracing.errors).items()):
            errors.add_metric([stage], n)
        yield errors


def _le(bound: float) -> str:
    return f"{bound:g}" if bound != int(bound) else f"{int(bound)}.0"


def pool_metrics(shared: SharedPool | None) -> list[GaugeMetricFamily]:
    """The cluster's shared spare pool (none without one): its usable spares and its recommended size."""
    if shared is None:
        return []
    available = GaugeMetricFamily(
        "opsd_spare_pool_available", "Usable spares of the cluster's shared pool.", labels=["pool"]
    )
    available.add_metric(["shared"], float(shared.available))
    recommended = GaugeMetricFamily(
        "opsd_spare_pool_recommended", "Recommended size of the cluster's shared spare pool.", labels=["pool"]
    )
    recommended.add_metric(["shared"], float(shared.recommended))
    return [available, recommended]


def liveness_metrics(controller: Controller, stats: ApiStats, now_s: float) -> list[Metric]:
    """The liveness datagrams taken and refused, the nodes by the channel of their liveness, and the interval the
    agents are asked to send their ranks at."""
    taken = CounterMetricFamily(
        "opsd_controller_liveness_datagrams", "Liveness datagrams taken.", value=controller.datagrams_total
    )
    refused = CounterMetricFamily(
        "opsd_controller_liveness_refused", "Liveness datagrams refused, by reason.", labels=["reason"]
    )
    for reason in DATAGRAM_REASONS:
        refused.add_metric([reason], stats.datagrams_refused.get(reason, 0))
    channels = GaugeMetricFamily(
        "opsd_controller_nodes_liveness",
        "Nodes heard from in the last minute, by the channel of their liveness.",
        labels=["channel"],
    )
    for channel, nodes in sorted(controller.liveness_channels(now_s).items()):
        channels.add_metric([channel], float(nodes))
    interval = GaugeMetricFamily(
        "opsd_controller_telemetry_interval_seconds",
        "How often agents are asked to send their ranks (the heartbeat replies' telemetry_interval_s).",
        value=controller.telemetry.interval_s,
    )
    return [taken, refused, channels, interval]
