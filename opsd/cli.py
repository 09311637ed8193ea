"""The ``opsd`` command line."""

from __future__ import annotations

import json
import logging
import signal
import socket
import threading
from typing import Any

import typer

from opsd import __version__
from opsd.errors import OpsError

app = typer.Typer(
    name="opsd",
    help="Operations and observability for long distributed PyTorch training runs.",
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
    from opsd.server import ServeConfig, run_server

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
    on_no_spare: str = typer.Option("wait", help="no spare left: wait for one, or shrink (relaunch on fewer nodes)"),
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

    from opsd.local import LocalRunSpec
    from opsd.runner import run_local
    from opsd.server import ServeConfig

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


def _inject(run: str, url: str, token: str, state_dir: str, body: dict[str, object]) -> None:
    from opsd.client import ApiClient

    try:
        reply = ApiClient(url, token or None, state_dir).post(f"/v1/runs/{run}/inject", body)
    except OpsError as exc:
        typer.echo(f"opsd inject: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(reply["injected"])


URL = typer.Option("http://127.0.0.1:8470", "--url", envvar="OPSD_URL", help="the controller")
TOKEN = typer.Option("", "--token", envvar="OPSD_TOKEN", help="bearer token (default: STATE_DIR/token)")
STATE = typer.Option(".opsd", "--state-dir", envvar="OPSD_STATE_DIR", help="where the token file is")
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
def status(
    run: str = typer.Argument(..., help="the run"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
    url: str = URL,
    token: str = TOKEN,
    state_dir: str = STATE,
) -> None:
    """A run's state: step, MFU, tokens/s, ETTR, cadence, nodes, spares, stragglers. Exit 1: no such run or no
    controller."""
    from rich.console import Console
    from rich.table import Table

    body = _get(url, token, state_dir, f"/v1/runs/{run}")
    if as_json:
        typer.echo(json.dumps(body))
        return
    table = Table(title=f"run {run}", show_header=False)
    cadence = body["cadence"]
    rows = [
        ("state", f"{body['state']} (launch {body['generation']})"),
        ("step", str(body["step"])),
        ("ranks", str(body["ranks"])),
        ("MFU", f"{body['mfu_ratio']:.3f}"),
        ("tokens/s", f"{body['tokens_per_s']:.0f}"),
        ("ETTR", f"{body['ettr']:.3f}"),
        ("checkpoint cadence", f"every {cadence['every_steps']} steps from {cadence['from_step']}" if cadence else "-"),
        ("nodes", ", ".join(f"{n['name']} ({n['role']})" for n in body["nodes"]) or "-"),
        ("spares available", str(body["spares_available"])),
        ("stragglers", ", ".join(f"rank {s['rank']} {s['slowdown_ratio']:.2f}x" for s in body["stragglers"]) or "none"),
        ("open incidents", str(body["open_incidents"])),
    ]
    for key, value in rows:
        table.add_row(key, value)
    Console().print(table)


@app.command()
def incidents(
    run: str = typer.Argument(..., help="the run"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
    url: str = URL,
    token: str = TOKEN,
    state_dir: str = STATE,
) -> None:
    """A run's incidents, oldest first. Exit 1: no such run or no controller."""
    from rich.console import Console
    from rich.table import Table

    body = _get(url, token, state_dir, f"/v1/runs/{run}/incidents")
    if as_json:
        typer.echo(json.dumps(body))
        return
    table = Table(title=f"incidents of {run}")
    columns = ("id", "kind", "node", "rank", "state", "detected after s", "recovered after s", "lost steps")
    for column in columns:
        table.add_column(column, no_wrap=True)
    table.add_column("detail", overflow="fold")
    for i in body:
        recovered = f"{i['resumed_s'] - i['detected_s']:.1f}" if i["resumed_s"] else "-"
        table.add_row(
            str(i["id"]),
            i["kind"],
            i["node"],
            "-" if i["rank"] is None else str(i["rank"]),
            i["state"],
            f"{i['detected_s'] - i['failed_s']:.1f}",
            recovered,
            "-" if i["lost_steps"] is None else str(i["lost_steps"]),
            i["detail"],
        )
    Console().print(table)


def _get(url: str, token: str, state_dir: str, path: str) -> Any:
    from opsd.client import ApiClient

    try:
        return ApiClient(url, token or None, state_dir).get(path)
    except OpsError as exc:
        typer.echo(f"opsd: {exc}", err=True)
        raise typer.Exit(1) from None
