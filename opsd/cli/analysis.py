"""The analysis commands: ``opsd simulate`` (a long run's goodput under opsd's or fixed policies) and ``opsd plan``
(per-GPU memory, pipeline bubble and communication of a model on a mesh). Neither talks to a controller."""

from __future__ import annotations

import json
import math
from typing import Annotated, Any

import typer


def simulate(
    preset: Annotated[str, typer.Option(help="workload: llama3-405b, bloom-176b, opt-175b, or custom")] = "llama3-405b",
    gpus: Annotated[
        int, typer.Option(help="job size in GPUs (default: the preset's; the per-GPU failure rate is kept)")
    ] = 0,
    gpus_per_node: Annotated[int, typer.Option(help="GPUs per node (custom workloads)")] = 8,
    failures_per_day: Annotated[
        float, typer.Option(help="interruptions of the whole job per day (custom workloads)")
    ] = 0.0,
    mix: Annotated[str, typer.Option(help="cause mix of a custom workload: category=weight,...")] = "GPU=1",
    days: Annotated[float, typer.Option(help="length of the run (default: the preset's)")] = 0.0,
    interval: Annotated[
        str, typer.Option(help="checkpoint interval: adaptive, 900 (s), 30m, 3h, or steps:N")
    ] = "adaptive",
    spares: Annotated[str, typer.Option(help="spare pool: binomial, or a number of nodes")] = "binomial",
    spare_risk: Annotated[
        float, typer.Option(help="binomial pool: P(more failures than spares in a repair window)")
    ] = 0.001,
    detection: Annotated[str, typer.Option(help="detection delays: opsd, or watchdog (a job without opsd)")] = "opsd",
    checkpoint_blocking_s: Annotated[float, typer.Option(help="seconds a checkpoint stops training")] = 1.0,
    checkpoint_background_s: Annotated[float, typer.Option(help="seconds until a checkpoint is durable")] = 30.0,
    restart_s: Annotated[float, typer.Option(help="seconds to relaunch and restore, a spare in hand")] = 120.0,
    repair_h: Annotated[float, typer.Option(help="hours until a failed node is back in the spare pool")] = 24.0,
    step_time_s: Annotated[float, typer.Option(help="seconds per training step")] = 5.0,
    replica_groups: Annotated[
        int, typer.Option(help="fault-tolerant replica groups (docs/ft.md): a failure restarts its group alone")
    ] = 1,
    min_replicas: Annotated[
        int, typer.Option(help="the fewest groups a quorum has; fewer: the whole job restarts")
    ] = 1,
    heal_s: Annotated[
        float, typer.Option(help="seconds to relaunch a replica group and heal it from a live one, a spare in hand")
    ] = 120.0,
    quorum_stall_s: Annotated[float, typer.Option(help="seconds the other groups stall once a group died")] = 2.1,
    collective_timeout_s: Annotated[
        float, typer.Option(help="seconds the other groups wait on a failed group in a collective, untold (torchft's)")
    ] = 60.0,
    survivors_told: Annotated[
        bool, typer.Option(help="opsd names a failed group to the others, who stop waiting on it (docs/ft.md)")
    ] = True,
    signal_s: Annotated[float, typer.Option(help="seconds from a detection to the other groups' ranks")] = 1.0,
    communicator_rebuild_s: Annotated[
        float, typer.Option(help="seconds every group waits for a new communicator at each change of the quorum")
    ] = 5.0,
    heal_transfer_s: Annotated[
        float, typer.Option(help="seconds every group waits while a rejoining group reads a peer's state")
    ] = 2.4,
    straggler_episodes_per_day: Annotated[float, typer.Option(help="straggler episodes of the job per day")] = 0.0,
    straggler_duration_h: Annotated[float, typer.Option(help="mean length of a straggler episode left alone")] = 2.0,
    straggler_slowdown: Annotated[float, typer.Option(help="the job's slowdown during an episode")] = 1.3,
    swap_stragglers: Annotated[bool, typer.Option(help="swap a flagged straggler (opsd) or leave it")] = True,
    replicas: Annotated[int, typer.Option(help="independent runs, summed")] = 4,
    seed: Annotated[int, typer.Option()] = 0,
    plot: Annotated[str, typer.Option(help="PNG path: sweep fixed intervals and plot ETTR against the interval")] = "",
    sweep_points: Annotated[int, typer.Option(help="fixed intervals in the sweep of --plot")] = 25,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON instead of a table")] = False,
) -> None:
    """Simulate a long run's goodput: ETTR and badput by bucket under a checkpoint cadence, a spare pool and a
    failure workload (docs/simulation.md). Exit 1: the plot cannot be written; 2: bad arguments."""
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from opsd.analysis import simulation
    from opsd.analysis.presets import custom_workload, presets
    from opsd.analysis.stragglers import Stragglers
    from opsd.policy.cadence import daly_interval_s

    try:
        if preset == "custom":
            workload = custom_workload(gpus, gpus_per_node, failures_per_day, mix, days or 30.0)
        elif preset in presets():
            workload = presets()[preset]
            workload = workload.scaled(gpus) if gpus else workload
        else:
            raise ValueError(f"no preset {preset!r}: llama3-405b, bloom-176b, opt-175b or custom")
        costs = simulation.Costs(
            checkpoint_blocking_s,
            checkpoint_background_s,
            restart_s,
            repair_h,
            step_time_s,
            heal_s,
            quorum_stall_s,
            collective_timeout_s=collective_timeout_s,
            signal_s=signal_s,
            communicator_rebuild_s=communicator_rebuild_s,
            heal_transfer_s=heal_transfer_s,
        )
        policy = simulation.Policy(
            interval_s=simulation.parse_interval(interval, step_time_s),
            spares=None if spares == "binomial" else _non_negative_int(spares, "spares"),
            detection=detection,
            swap_stragglers=swap_stragglers,
            spare_risk=spare_risk,
            replica_groups=replica_groups,
            min_replicas=min_replicas,
            survivors_told=survivors_told,
        )
        stragglers = Stragglers(straggler_episodes_per_day, straggler_duration_h, straggler_slowdown)
        scenario = simulation.Scenario(workload, days or workload.days, costs, stragglers, seed, replicas)
        if plot and sweep_points < 2:
            raise ValueError("--sweep-points must be >= 2")
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    result = simulation.simulate(scenario, policy)
    body: dict[str, Any] = {"workload": workload.name, "gpus": workload.gpus, "days": scenario.days}
    body.update(result.as_dict())
    if plot:
        mtbf_s = 86400.0 / workload.failures_per_day if workload.failures_per_day else math.inf
        daly = daly_interval_s(checkpoint_blocking_s, mtbf_s) if math.isfinite(mtbf_s) else 24 * 3600.0
        grid = simulation.log_grid(max(10.0, daly / 8), daly * 8, sweep_points)
        with Progress(transient=True, disable=as_json) as progress:
            task = progress.add_task("sweeping fixed intervals", total=len(grid))
            swept = simulation.sweep(scenario, policy, grid, lambda: progress.advance(task))
        best = max(swept, key=lambda r: r.ettr)
        from opsd.analysis.plots import plot_ettr_sweep

        title = f"{workload.name} on {workload.gpus} GPUs, {scenario.days:g} days"
        try:
            plot_ettr_sweep(grid, [r.ettr for r in swept], (result.mean_interval_s, result.ettr), daly, title, plot)
        except OSError as exc:
            typer.echo(f"opsd simulate: cannot write the plot {plot}: {exc}", err=True)
            raise typer.Exit(1) from None
        body["sweep"] = {"best_interval_s": best.mean_interval_s, "best_ettr": best.ettr, "plot": plot}
    if as_json:
        typer.echo(json.dumps(body))
        return
    table = Table(title=f"{workload.name}, {workload.gpus} GPUs, {scenario.days:g} days x {replicas}")
    table.add_column("")
    table.add_column("hours", justify="right")
    table.add_column("share", justify="right")
    table.add_row("productive", f"{result.productive_s / 3600:.1f}", f"{result.ettr:.2%}")
    for bucket, seconds in result.badput_s.items():
        table.add_row(bucket.replace("_", " "), f"{seconds / 3600:.1f}", f"{seconds / result.wall_s:.2%}")
    console = Console()
    console.print(table)
    console.print(
        f"{result.policy}\nETTR {result.ettr:.4f}; {result.failures} failures ({result.swaps} swaps), "
        f"{result.planned} planned stops, "
        f"{result.spares} spares, "
        f"checkpoint every {result.mean_interval_s:.0f} s on average, "
        f"{result.lost_work_per_failure_s / 60:.1f} min of work lost per failure"
        + (f", {result.replica_recoveries} recovered by their replica group alone" if replica_groups > 1 else "")
    )
    if plot:
        sweep = body["sweep"]
        best_s, best_ettr = sweep["best_interval_s"], sweep["best_ettr"]
        console.print(f"best fixed interval {best_s:.0f} s: ETTR {best_ettr:.4f}; plot {plot}")


def plan(
    model: Annotated[
        str, typer.Argument(help="llama3-8b, llama3-70b, llama3-405b, or layers=..,hidden=..,heads=..,...")
    ],
    mesh: Annotated[str, typer.Argument(help="e.g. dp_shard=128,tp=8,pp=16 (dp_replicate, dp_shard, tp, pp, cp, ep)")],
    sharding: Annotated[
        str, typer.Option(help="none, zero1, zero2, zero3 or fsdp, over the data-parallel group")
    ] = "zero3",
    micro_batch_size: Annotated[int, typer.Option(help="sequences per micro-batch")] = 1,
    seq_len: Annotated[int, typer.Option(help="tokens per sequence")] = 8192,
    micro_batches: Annotated[int, typer.Option(help="micro-batches per step (per pipeline)")] = 1,
    checkpointing: Annotated[str, typer.Option(help="activation checkpointing: none, selective or full")] = "selective",
    sequence_parallel: Annotated[bool, typer.Option(help="shard the activations outside the TP regions too")] = True,
    gpu_memory_gb: Annotated[float, typer.Option(help="memory per GPU, GB (1e9 bytes)")] = 80.0,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON instead of a table")] = False,
) -> None:
    """Per-GPU memory (weights, gradients, optimizer, activations), pipeline bubble and communication per step of a
    model on a parallel mesh (docs/planner.md). Exit 0: it fits; 1: it does not; 2: bad arguments."""
    from rich.console import Console

    from opsd.analysis import planner

    try:
        spec = planner.parse_model(model)
        layout = planner.parse_mesh(mesh)
        options = planner.PlanOptions(
            sharding=sharding,
            micro_batch_size=micro_batch_size,
            seq_len=seq_len,
            micro_batches=micro_batches,
            checkpointing=checkpointing,
            sequence_parallel=sequence_parallel,
            gpu_memory_bytes=gpu_memory_gb * 1e9,
        )
        result = planner.plan(spec, layout, options)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if as_json:
        typer.echo(json.dumps(planner.plan_to_dict(result)))
    else:
        Console().print(planner.render_table(result))
    raise typer.Exit(0 if result.fits else 1)


def _non_negative_int(text: str, name: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"--{name} must be a whole number or binomial, not {text!r}") from None
    if value < 0:
        raise ValueError(f"--{name} must be >= 0")
    return value


def register(app: typer.Typer) -> None:
    app.command()(simulate)
    app.command()(plan)
