"""The panels of opsd's five Grafana dashboards, made of the builders of ``opsd.dashboards.widgets`` (over Grafana's
foundation SDK). ``opsd.dashboards.build`` writes, checks and validates them; docs/dashboards.md describes them.

Every query reads the ``${datasource}`` variable's Prometheus and filters by the ``run`` variable (one run) and,
for per-rank and per-GPU series, by ``node`` and ``rank`` (several or All). Agents' per-rank and per-GPU series get
their ``node`` label from the scrape config (a target label, with ``honor_labels: true``); the controller's series
carry ``run`` only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opsd.dashboards.widgets import (
    GPU,
    NODES,
    RANKS,
    RUN,
    dashboard,
    heatmap,
    stat,
    table,
    ts,
    variables,
)


# -- the dashboards ------------------------------------------------------------------------------------------------
def training() -> dict[str, Any]:
    p50, p99 = (f"quantile_over_time({q}, opsd_step_seconds{{{RANKS}}}[5m])" for q in ("0.5", "0.99"))
    panels = [
        stat("MFU now", "percentunit", (f"opsd_run_mfu_ratio{{{RUN}}}", "MFU")),
        stat("Tokens per second now", "short", (f"opsd_run_tokens_per_second{{{RUN}}}", "tokens/s")),
        stat("Step now", "none", (f"opsd_run_step{{{RUN}}}", "step")),
        stat("Run state", "none", (f"opsd_run_state{{{RUN}}} == 1", "{{state}}"), names=True),
        ts(
            "MFU",
            "percentunit",
            (f"opsd_run_mfu_ratio{{{RUN}}}", "job"),
            (f"opsd_mfu_ratio{{{RANKS}}}", "rank {{rank}}"),
            lo=0,
            about="Model FLOPs utilisation: the job's (mean of the ranks' last steps) and each rank's.",
        ),
        ts(
            "Tokens per second",
            "short",
            (f"opsd_run_tokens_per_second{{{RUN}}}", "job"),
            (f"opsd_tokens_per_second{{{RANKS}}}", "rank {{rank}} (its data-parallel shard)"),
            lo=0,
        ),
        ts("Step time per rank, p50 over 5 m", "s", (p50, "rank {{rank}}"), about="Of the sampled last steps."),
        ts("Step time per rank, p99 over 5 m", "s", (p99, "rank {{rank}}"), about="Of the sampled last steps."),
        ts("Loss", "short", (f"opsd_loss{{{RANKS}}}", "rank {{rank}}"), about="Of each rank's last reported step."),
        ts(
            "Steps per second per rank",
            "short",
            (f"rate(opsd_steps_total{{{RANKS}}}[$__rate_interval])", "rank {{rank}}"),
            lo=0,
        ),
        ts(
            "Memory per rank",
            "bytes",
            (f"opsd_memory_bytes{{{RANKS}}}", "rank {{rank}} {{kind}}"),
            about="rss on CPU; the last step's allocated and reserved peaks on CUDA.",
        ),
        ts(
            "Compute and exposed communication per step (mean over ranks)",
            "s",
            (f"avg(opsd_step_compute_seconds{{{RANKS}}})", "compute"),
            (f"avg(opsd_step_exposed_comm_seconds{{{RANKS}}})", "exposed communication"),
            lo=0,
        ),
        ts(
            "Pipeline bubble, measured and theory",
            "percentunit",
            (f"opsd_run_pipeline_bubble_ratio{{{RUN}}}", "run, measured"),
            (f"opsd_pipeline_bubble_theoretical_ratio{{{RUN}}}", "run, theory (p - 1) / (m + p - 1)"),
            (f"opsd_pipeline_bubble_ratio{{{RANKS}}}", "rank {{rank}}"),
            lo=0,
            about="Share of the step each pipeline stage waits on its neighbours; first and last stages wait at "
            "different ends of the step, a slow stage shows as a larger bubble on the others.",
        ),
    ]
    about = "MFU, tokens per second, step time per rank, loss and pipeline bubble of a run."
    return dashboard("opsd-training", "opsd / Training", about, variables("run", "node", "rank"), panels, 100)


def communication() -> dict[str, Any]:
    seconds = f"rate(opsd_collective_seconds_total{{{RANKS}}}[$__rate_interval])"
    count = f"rate(opsd_collectives_total{{{RANKS}}}[$__rate_interval])"
    size = f"rate(opsd_collective_bytes_total{{{RANKS}}}[$__rate_interval])"
    panels = [
        ts(
            "Time in collectives by dimension and op (mean over ranks)",
            "percentunit",
            (f"avg by (dimension, op) ({seconds})", "{{dimension}} {{op}}"),
            lo=0,
            about="Seconds per second each rank spends in collectives, issue to completion (overlapped time "
            "included, so it can exceed 100%).",
        ),
        ts(
            "Time in collectives per rank and dimension",
            "percentunit",
            (f"sum by (rank, dimension) ({seconds})", "rank {{rank}} {{dimension}}"),
            lo=0,
        ),
        ts(
            "Exposed and overlapped communication per step (mean over ranks)",
            "s",
            (f"avg(opsd_step_exposed_comm_seconds{{{RANKS}}})", "exposed (training waited)"),
            (f"avg(opsd_step_overlapped_comm_seconds{{{RANKS}}})", "overlapped (hidden behind compute)"),
            (f"avg(opsd_step_seconds{{{RANKS}}})", "step"),
            lo=0,
        ),
        ts(
            "Exposed communication share of the step per rank",
            "percentunit",
            (f"opsd_step_exposed_comm_seconds{{{RANKS}}} / opsd_step_seconds{{{RANKS}}}", "rank {{rank}}"),
            lo=0,
            hi=1,
        ),
        ts(
            "Collective bytes per second by dimension and op (all selected ranks)",
            "Bps",
            (f"sum by (dimension, op) ({size})", "{{dimension}} {{op}}"),
            lo=0,
            about="Full-buffer bytes (as nccl-tests counts them) per second.",
        ),
        ts("Collective bytes per second per rank", "Bps", (f"sum by (rank) ({size})", "rank {{rank}}"), lo=0),
        ts(
            "Collectives per second by dimension and op (all selected ranks)",
            "ops",
            (f"sum by (dimension, op) ({count})", "{{dimension}} {{op}}"),
            lo=0,
        ),
        ts(
            "Mean collective duration by dimension and op",
            "s",
            (f"sum by (dimension, op) ({seconds}) / sum by (dimension, op) ({count})", "{{dimension}} {{op}}"),
            lo=0,
        ),
    ]
    about = "Time and bytes in collectives by parallel dimension and op; exposed against overlapped communication."
    return dashboard("opsd-communication", "opsd / Communication", about, variables("run", "node", "rank"), panels, 200)


def stragglers() -> dict[str, Any]:
    median_compute = f"on (run) group_left () quantile by (run) (0.5, opsd_step_compute_seconds{{{RUN}}})"
    median_step = f"quantile by (run) (0.5, opsd_step_seconds{{{RUN}}})"
    flagged = f"opsd_run_straggler_slowdown_ratio{{{RANKS}}}"
    panels = [
        heatmap(
            "Relative compute time per rank (rank / run median)",
            (f"opsd_step_compute_seconds{{{RANKS}}} / {median_compute}", "rank {{rank}} ({{node}})"),
            width=24,
            height=10,
            about="Each rank's last-step compute time (not blocked in collectives) over the median of the run's "
            "ranks: 1 is typical; a row that stays above 1.1 is a straggler.",
        ),
        table(
            "Flagged stragglers",
            flagged,
            "slowdown",
            about="Ranks the controller flags now, with their compute time over their peers' median.",
        ),
        ts("Ranks flagged as stragglers", "none", (f"opsd_run_stragglers{{{RUN}}}", "flagged ranks"), lo=0),
        ts("Slowdown of flagged ranks", "none", (flagged, "rank {{rank}} on {{node}}")),
        ts(
            "Slowest rank against the median step time",
            "none",
            (f"max by (run) (opsd_step_seconds{{{RUN}}}) / {median_step}", "max / median"),
            lo=1,
        ),
        ts(
            "Relative step time per rank (rank / run median)",
            "none",
            (f"opsd_step_seconds{{{RANKS}}} / on (run) group_left () {median_step}", "rank {{rank}}"),
        ),
        ts(
            "Exposed communication per rank",
            "s",
            (f"opsd_step_exposed_comm_seconds{{{RANKS}}}", "rank {{rank}}"),
            lo=0,
            about="A rank that waits much less than its peers is often the one they are all waiting for.",
        ),
    ]
    about = "Ranks slower than their peers: relative compute time per rank, and the ranks the controller flags."
    return dashboard("opsd-stragglers", "opsd / Stragglers", about, variables("run", "node", "rank"), panels, 300)


def reliability() -> dict[str, Any]:
    buckets = f"opsd_run_recovery_seconds_bucket{{{RUN}}}"
    panels = [
        stat("Run state", "none", (f"opsd_run_state{{{RUN}}} == 1", "{{state}}"), names=True),
        stat("ETTR so far", "percentunit", (f"opsd_run_ettr_ratio{{{RUN}}}", "ETTR")),
        stat("MTBF estimate now", "s", (f"opsd_run_mtbf_seconds{{{RUN}}}", "MTBF")),
        stat("Recoveries", "none", (f"opsd_run_recovery_seconds_count{{{RUN}}}", "recovered incidents")),
        stat("Recoveries held (maintenance)", "none", (f"opsd_run_maintenance{{{RUN}}}", "held")),
        stat("Agents down, ranks training", "none", (f"opsd_run_agents_down{{{RUN}}}", "nodes")),
        ts(
            "Incidents by cause",
            "none",
            (f"sum by (cause) (opsd_run_incidents_total{{{RUN}}})", "{{cause}}"),
            lo=0,
            about="Incidents of the run so far, by cause (from the controller's state store).",
        ),
        ts(
            "Effective training time ratio (ETTR)",
            "percentunit",
            (f"opsd_run_ettr_ratio{{{RUN}}}", "ETTR"),
            lo=0,
            hi=1,
            about="Productive time over wall time since the run started.",
        ),
        ts(
            "Recovery time (detection to first productive step)",
            "s",
            (f"histogram_quantile(0.5, sum by (le) ({buckets}))", "p50"),
            (f"histogram_quantile(0.9, sum by (le) ({buckets}))", "p90"),
            (f"opsd_run_recovery_seconds_sum{{{RUN}}} / opsd_run_recovery_seconds_count{{{RUN}}}", "mean"),
            lo=0,
            about="Over every recovered incident of the run so far.",
        ),
        ts(
            "MTBF estimate",
            "s",
            (f"opsd_run_mtbf_seconds{{{RUN}}}", "MTBF"),
            lo=0,
            about="The mean time between failures the checkpoint cadence is planned for.",
        ),
        ts(
            "Checkpoint interval and age of the newest checkpoint",
            "s",
            (f"opsd_run_checkpoint_interval_seconds{{{RUN}}}", "interval"),
            (f"time() - opsd_run_checkpoint_last_commit_timestamp_seconds{{{RUN}}}", "age of the newest"),
            (f"2 * opsd_run_checkpoint_interval_seconds{{{RUN}}}", "stale (alert) threshold"),
            lo=0,
        ),
        ts("Checkpoint cadence (steps)", "none", (f"opsd_run_checkpoint_interval_steps{{{RUN}}}", "every"), lo=0),
        ts(
            "Checkpoint cost",
            "s",
            (f"opsd_run_checkpoint_cost_seconds{{{RUN}}}", "blocking, mean per checkpoint"),
            lo=0,
            about="Mean seconds a checkpoint stops training (the cost the cadence is planned with).",
        ),
        ts(
            "Spare nodes",
            "none",
            (f"opsd_run_spares_available{{{RUN}}}", "available"),
            (f"opsd_run_spares_recommended{{{RUN}}}", "recommended"),
            lo=0,
        ),
        ts(
            "Replica groups in the quorum",
            "none",
            (f"opsd_run_quorum_replica_groups{{{RUN}}}", "in the quorum"),
            (f"opsd_run_replica_groups{{{RUN}}}", "laid out"),
            (f"opsd_run_replica_groups_out{{{RUN}}}", "out of service"),
            lo=0,
            about="A fault-tolerant run's replica groups (torchft): the quorum dips while a group is recovered alone.",
        ),
        ts(
            "Time since the step last advanced",
            "s",
            (f"time() - opsd_run_last_progress_timestamp_seconds{{{RUN}}}", "since progress"),
            lo=0,
        ),
        ts("Run state over time", "none", (f"opsd_run_state{{{RUN}}}", "{{state}}"), lo=0, hi=1),
    ]
    about = "Incidents, ETTR, MTBF, checkpoint cadence and cost, spare nodes and recovery times of a run."
    return dashboard("opsd-reliability", "opsd / Reliability", about, variables("run"), panels, 400)


def gpu_health() -> dict[str, Any]:
    reasons = f"opsd_gpu_clock_event_reasons{{{NODES}}}"
    fatal = f'sum(opsd_gpu_health_actions_total{{{NODES}, action="cordon_and_swap"}})'
    ecc = f'sum by (node, gpu, type) (opsd_gpu_ecc_errors_total{{{NODES}, scope="volatile"}})'
    panels = [
        stat("Fatal XIDs (cordon and swap)", "none", (fatal, "fatal XIDs"), height=8),
        table(
            "Health actions",
            f"opsd_gpu_health_actions_total{{{NODES}}}",
            "events",
            width=18,
            about="XID events that call for an action: cordon_and_swap (fatal) or restart_job.",
        ),
        ts(
            "XID events",
            "none",
            (f"opsd_gpu_xid_errors_total{{{NODES}}}", f"{GPU} XID {{{{xid}}}}"),
            lo=0,
            about="Events per GPU and XID code since the agent started (a step up is an event).",
        ),
        ts("ECC errors (volatile)", "none", (ecc, f"{GPU} {{{{type}}}}"), lo=0),
        ts("Temperature", "celsius", (f"opsd_gpu_temperature_celsius{{{NODES}}}", GPU)),
        ts(
            "Clocks held down, by reason",
            "none",
            (f"floor({reasons} / 4) % 2", f"{GPU} power cap"),
            (f"floor({reasons} / 8) % 2", f"{GPU} hardware slowdown"),
            (f"clamp_max(floor({reasons} / 32) % 4, 1)", f"{GPU} thermal"),
            (f"floor({reasons} / 128) % 2", f"{GPU} power brake"),
            lo=0,
            hi=1,
            about="NVML clock event reasons: 1 while the reason holds the clocks down (power cap 0x4, hardware "
            "slowdown 0x8, software or hardware thermal 0x20/0x40, power brake 0x80).",
        ),
        ts("SM clock", "hertz", (f"opsd_gpu_sm_clock_hertz{{{NODES}}}", GPU)),
        ts("Power", "watt", (f"opsd_gpu_power_watts{{{NODES}}}", GPU), lo=0),
        ts(
            "Memory rows and pages",
            "none",
            (f"opsd_gpu_row_remap_pending{{{NODES}}}", f"{GPU} row remap pending"),
            (f"opsd_gpu_remapped_rows{{{NODES}}}", f"{GPU} rows remapped ({{{{kind}}}})"),
            (f"opsd_gpu_retired_pages{{{NODES}}}", f"{GPU} pages retired ({{{{cause}}}})"),
            lo=0,
        ),
        ts(
            "NVLink errors per second",
            "none",
            (f"rate(opsd_gpu_nvlink_errors_total{{{NODES}}}[$__rate_interval])", GPU),
            lo=0,
        ),
    ]
    about = "XIDs, ECC errors, temperature, clocks and power of the GPUs of a run's nodes (All: every node)."
    return dashboard("opsd-gpu-health", "opsd / GPU health", about, variables("run", "node"), panels, 500)


BUILDERS: dict[str, Callable[[], dict[str, Any]]] = {
    "training": training,
    "communication": communication,
    "stragglers": stragglers,
    "reliability": reliability,
    "gpu-health": gpu_health,
}
