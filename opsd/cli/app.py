"""The ``opsd`` command line."""

from __future__ import annotations

import json
import logging
import math
import signal
import socket
import threading
from typing import Annotated, Any

import typer

from opsd import __version__
from opsd.cli.dashboards import dashboards_app
from opsd.cli.ops import STATE, TOKEN, URL, call, client, register
from opsd.errors import OpsError
from opsd.policy.recovery import OnNoSpare

app = typer.Typer(
    name="opsd",
    help="Operations and observability for long distributed PyTorch training runs.",
    epilog=(
        "Exit codes: 0 done; 1 the controller refused, failed or could not be reached (reason on stderr);"
        " 2 a bad command line or config file; 3 restart --wait gave up waiting. `opsd run` exits 1 unless the run"
        " completed, `opsd plan` 1 when the layout does not fit."
    ),
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def main() -> None:
    """opsd: watch, heal and explain long distributed training runs."""


@app.command()
def version() -> None:
    """Print the opsd version."""
    typer.echo(__version__)


@app.command()
def agent(
    socket_path: str = typer.Option(
        "/tmp/opsd-agent.sock", "--socket", envvar="OPSD_AGENT_SOCKET", help="Unix datagram socket ranks send to"
    ),
    metrics_host: str = typer.Option("127.0.0.1", help="address of /metrics and /healthz"),
    metrics_port: int = typer.Option(9464, help="port of /metrics and /healthz (0: any free port)"),
    node: str = typer.Option("", help="node name in metrics (default: host name)"),
    gpu_source: str = typer.Option("none", help="GPU health: nvml, none, or file:DIRECTORY (the fake)"),
    gpu_interval_s: float = typer.Option(5.0, help="seconds between GPU health samples"),
    xid_table: str = typer.Option("", help="CSV xid,meaning,default_action (default: the table shipped)"),
    controller_url: str = typer.Option("", help="controller heartbeat endpoint (none: no heartbeats)"),
    controller_token: str = typer.Option("", envvar="OPSD_CONTROLLER_TOKEN", help="bearer token for the controller"),
    heartbeat_interval_s: float = typer.Option(1.0, help="seconds between heartbeats"),
    policy_file: str = typer.Option("", envvar="OPSD_POLICY_FILE", help="where the ranks read the controller's policy"),
    flight_dir: str = typer.Option(
        "", envvar="OPSD_FLIGHT_DIR", help="where the ranks write Flight Recorder dumps (sent to the controller)"
    ),
    log_level: str = typer.Option("INFO"),
) -> None:
    """Run the node agent: rank reports in, Prometheus metrics out."""
    from agent.daemon import Agent, AgentConfig

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = AgentConfig(
            socket_path=socket_path,
            metrics_host=metrics_host,
            metrics_port=metrics_port,
            node=node or socket.gethostname(),
            gpu_source=gpu_source,
            gpu_interval_s=gpu_interval_s,
            xid_table_path=xid_table or None,
            controller_url=controller_url or None,
            controller_token=controller_token,
            heartbeat_interval_s=heartbeat_interval_s,
            policy_path=policy_file or None,
            flight_dir=flight_dir or None,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    daemon = Agent(config)
    try:
        daemon.start()
    except (OSError, OpsError) as exc:
        typer.echo(f"opsd agent: cannot start: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(
        f"opsd agent: datagrams on {socket_path}, metrics on http://{metrics_host}:{daemon.metrics_port}/metrics"
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    daemon.stop()


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="address of the API"),
    port: int = typer.Option(8470, help="port of the API"),
    state_dir: str = typer.Option(".opsd", envvar="OPSD_STATE_DIR", help="where the default state and token live"),
    state_url: str = typer.Option(
        "", envvar="OPSD_STATE_URL", help="sqlite:///path or postgresql+psycopg://... (default: STATE_DIR/opsd.db)"
    ),
    token: str = typer.Option(
        "", envvar="OPSD_TOKEN", help="bearer token of the mutating endpoints (default: STATE_DIR/token, made once)"
    ),
    tick_interval_s: float = typer.Option(0.5, help="seconds between failure-detection passes"),
    heartbeat_floor_s: float = typer.Option(10.0, help="a node is lost after at least this long without heartbeat"),
    hang_floor_s: float = typer.Option(60.0, help="a run hangs after at least this long without a step"),
    log_level: str = typer.Option("INFO"),
) -> None:
    """Run the controller: the HTTP API for agents and the CLI, failure detection, incidents (OpenAPI at
    /openapi.json, metrics at /metrics)."""
    from opsd.api.server import ServeConfig, run_server

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = ServeConfig(
            host=host,
            port=port,
            state_dir=state_dir,
            state_url=state_url,
            token=token,
            tick_interval_s=tick_interval_s,
            heartbeat_floor_s=heartbeat_floor_s,
            hang_floor_s=hang_floor_s,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    try:
        run_server(config)
    except OpsError as exc:
        typer.echo(f"opsd serve: {exc}", err=True)
        raise typer.Exit(1) from None


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run(
    ctx: typer.Context,
    name: str = typer.Option("run", "--run", help="the run's name"),
    nodes: int = typer.Option(2, help="nodes the run uses"),
    gpus_per_node: int = typer.Option(2, help="rank processes per node"),
    spares: int = typer.Option(1, help="hot spare nodes"),
    checkpoint_url: str = typer.Option("", help="where the trainer checkpoints (to tell the step it resumes from)"),
    host: str = typer.Option("127.0.0.1", help="address of the API"),
    port: int = typer.Option(8470, help="port of the API"),
    state_dir: str = typer.Option(".opsd", envvar="OPSD_STATE_DIR", help="state, token, and the nodes' files"),
    token: str = typer.Option("", envvar="OPSD_TOKEN", help="bearer token (default: STATE_DIR/token)"),
    heartbeat_floor_s: float = typer.Option(3.0, help="a node is lost after at least this long without heartbeat"),
    hang_floor_s: float = typer.Option(6.0, help="a run hangs after at least this long without a step"),
    on_no_spare: Annotated[
        OnNoSpare, typer.Option(help="no spare left: wait for one, or shrink (relaunch on fewer nodes)")
    ] = OnNoSpare.WAIT,
    min_nodes: int = typer.Option(1, help="shrink no further than this many nodes"),
    crash_after_action: str = typer.Option("", hidden=True),  # fault injection (tests): SIGKILL itself after it
    log_level: str = typer.Option("INFO"),
) -> None:
    """Run a training command on local "nodes" with a controller and hot spares: `opsd run --nodes 2
    --gpus-per-node 2 --spares 1 -- python -m examples.train ... --resume`. Failures are detected and recovered
    (swap, relaunch, resume from the newest checkpoint) until every rank exits 0. Run it again with the same --run
    and --state-dir to take up a run whose controller died; SIGINT or SIGTERM stops the run."""
    import signal
    import threading

    from opsd.api.server import ServeConfig
    from opsd.backends.local.runner import run_local
    from opsd.backends.local.spec import LocalRunSpec

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = ServeConfig(
            host=host,
            port=port,
            state_dir=state_dir,
            token=token,
            heartbeat_floor_s=heartbeat_floor_s,
            hang_floor_s=hang_floor_s,
        )
        spec = LocalRunSpec(
            run=name,
            command=tuple(ctx.args),
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            spares=spares,
            workdir=f"{state_dir}/runs",
            controller_url=f"http://{host}:{port}/v1/heartbeat",
            checkpoint_url=checkpoint_url,
            on_no_spare=on_no_spare,
            min_nodes=min_nodes,
            crash_after_action=crash_after_action,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        status = run_local(config, spec, stop=stop)
    except OpsError as exc:
        typer.echo(f"opsd run: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(json.dumps({k: status[k] for k in ("run", "state", "step", "ettr")}))
    raise typer.Exit(0 if status["state"] == "completed" else 1)


inject_app = typer.Typer(help="Inject a fault into a run of `opsd run` (local mode).", no_args_is_help=True)
app.add_typer(inject_app, name="inject")


def _inject(run: str, url: str | None, token: str | None, state_dir: str, body: dict[str, object]) -> None:
    reply = call(client(url, token, state_dir, None), "POST", f"/v1/runs/{run}/inject", body)
    typer.echo(reply["injected"])


RUN = typer.Option("run", "--run", help="the run")


@inject_app.command("xid")
def inject_xid(
    node: str = typer.Option(..., help="the node"),
    gpu: int = typer.Option(0, help="the GPU index"),
    xid: int = typer.Option(79, help="the XID code"),
    run: str = RUN,
    url: str = URL,
    token: str = TOKEN,
    state_dir: str = STATE,
) -> None:
    """An XID event on a node's GPU (written into its GPU source)."""
    _inject(run, url, token, state_dir, {"fault": "xid", "node": node, "gpu": gpu, "xid": xid})


@inject_app.command("kill")
def inject_kill(
    rank: int = typer.Option(..., help="the rank"),
    run: str = RUN,
    url: str = URL,
    token: str = TOKEN,
    state_dir: str = STATE,
) -> None:
    """SIGKILL a rank process."""
    _inject(run, url, token, state_dir, {"fault": "kill", "rank": rank})


@inject_app.command("hang")
def inject_hang(
    rank: int = typer.Option(..., help="the rank"),
    run: str = RUN,
    url: str = URL,
    token: str = TOKEN,
    state_dir: str = STATE,
) -> None:
    """SIGSTOP a rank process: the others wait for it in their next collective."""
    _inject(run, url, token, state_dir, {"fault": "hang", "rank": rank})


@inject_app.command("slow")
def inject_slow(
    rank: int = typer.Option(..., help="the rank"),
    factor: float = typer.Option(1.3, help="how many times slower"),
    run: str = RUN,
    url: str = URL,
    token: str = TOKEN,
    state_dir: str = STATE,
) -> None:
    """Slow a rank down by a factor (SIGSTOP/SIGCONT duty cycle)."""
    _inject(run, url, token, state_dir, {"fault": "slow", "rank": rank, "factor": factor})


@app.command()
def simulate(
    preset: str = typer.Option("llama3-405b", help="workload: llama3-405b, bloom-176b, opt-175b, or custom"),
    gpus: int = typer.Option(0, help="job size in GPUs (default: the preset's; the per-GPU failure rate is kept)"),
    gpus_per_node: int = typer.Option(8, help="GPUs per node (custom workloads)"),
    failures_per_day: float = typer.Option(0.0, help="interruptions of the whole job per day (custom workloads)"),
    mix: str = typer.Option("GPU=1", help="cause mix of a custom workload: category=weight,..."),
    days: float = typer.Option(0.0, help="length of the run (default: the preset's)"),
    interval: str = typer.Option("adaptive", help="checkpoint interval: adaptive, 900 (s), 30m, 3h, or steps:N"),
    spares: str = typer.Option("binomial", help="spare pool: binomial, or a number of nodes"),
    spare_risk: float = typer.Option(0.001, help="binomial pool: P(more failures than spares in a repair window)"),
    detection: str = typer.Option("opsd", help="detection delays: opsd, or watchdog (a job without opsd)"),
    checkpoint_blocking_s: float = typer.Option(1.0, help="seconds a checkpoint stops training"),
    checkpoint_background_s: float = typer.Option(30.0, help="seconds until a checkpoint is durable"),
    restart_s: float = typer.Option(120.0, help="seconds to relaunch and restore, a spare in hand"),
    repair_h: float = typer.Option(24.0, help="hours until a failed node is back in the spare pool"),
    step_time_s: float = typer.Option(5.0, help="seconds per training step"),
    straggler_episodes_per_day: float = typer.Option(0.0, help="straggler episodes of the job per day"),
    straggler_duration_h: float = typer.Option(2.0, help="mean length of a straggler episode left alone"),
    straggler_slowdown: float = typer.Option(1.3, help="the job's slowdown during an episode"),
    swap_stragglers: bool = typer.Option(True, help="swap a flagged straggler (opsd) or leave it"),
    replicas: int = typer.Option(4, help="independent runs, summed"),
    seed: int = typer.Option(0),
    plot: str = typer.Option("", help="PNG path: sweep fixed intervals and plot ETTR against the interval"),
    sweep_points: int = typer.Option(25, help="fixed intervals in the sweep of --plot"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
) -> None:
    """Simulate a long run's goodput: ETTR and badput by bucket under a checkpoint cadence, a spare pool and a
    failure workload (docs/simulation.md). Exit 1: the plot cannot be written; 2: bad arguments."""
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from opsd.analysis import simulation
    from opsd.analysis.presets import custom_workload, presets
    from opsd.policy.cadence import daly_interval_s

    try:
        if preset == "custom":
            workload = custom_workload(gpus, gpus_per_node, failures_per_day, mix, days or 30.0)
        elif preset in presets():
            workload = presets()[preset]
            workload = workload.scaled(gpus) if gpus else workload
        else:
            raise ValueError(f"no preset {preset!r}: llama3-405b, bloom-176b, opt-175b or custom")
        costs = simulation.Costs(checkpoint_blocking_s, checkpoint_background_s, restart_s, repair_h, step_time_s)
        policy = simulation.Policy(
            interval_s=simulation.parse_interval(interval, step_time_s),
            spares=None if spares == "binomial" else _non_negative_int(spares, "spares"),
            detection=detection,
            swap_stragglers=swap_stragglers,
            spare_risk=spare_risk,
        )
        stragglers = simulation.Stragglers(straggler_episodes_per_day, straggler_duration_h, straggler_slowdown)
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
        f"{result.spares} spares, "
        f"checkpoint every {result.mean_interval_s:.0f} s on average, "
        f"{result.lost_work_per_failure_s / 60:.1f} min of work lost per failure"
    )
    if plot:
        sweep = body["sweep"]
        best_s, best_ettr = sweep["best_interval_s"], sweep["best_ettr"]
        console.print(f"best fixed interval {best_s:.0f} s: ETTR {best_ettr:.4f}; plot {plot}")


@app.command()
def plan(
    model: str = typer.Argument(..., help="llama3-8b, llama3-70b, llama3-405b, or layers=..,hidden=..,heads=..,..."),
    mesh: str = typer.Argument(..., help="e.g. dp_shard=128,tp=8,pp=16 (dp_replicate, dp_shard, tp, pp, cp, ep)"),
    sharding: str = typer.Option("zero3", help="none, zero1, zero2, zero3 or fsdp, over the data-parallel group"),
    micro_batch_size: int = typer.Option(1, help="sequences per micro-batch"),
    seq_len: int = typer.Option(8192, help="tokens per sequence"),
    micro_batches: int = typer.Option(1, help="micro-batches per step (per pipeline)"),
    checkpointing: str = typer.Option("selective", help="activation checkpointing: none, selective or full"),
    sequence_parallel: bool = typer.Option(True, help="shard the activations outside the TP regions too"),
    gpu_memory_gb: float = typer.Option(80.0, help="memory per GPU, GB (1e9 bytes)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
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


register(app)
app.add_typer(dashboards_app, name="dashboards")
