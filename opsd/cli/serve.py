"""The commands that run opsd's processes: ``opsd agent`` (a node's agent), ``opsd serve`` (the controller) and
``opsd run`` (a controller with the local backend, supervising one run). Their settings come from the settings
object (``opsd.cli.settings``): the ``--config`` file, then ``OPSD_*`` variables, then these flags."""

from __future__ import annotations

import contextlib
import json
import logging
import shlex
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Annotated, Any

import typer

from opsd.cli import settings
from opsd.errors import ConfigError, OpsError
from opsd.policy.recovery import OnNoSpare
from opsd.protocol.states import RunState


def setting(help_text: str, *names: str) -> Any:
    """An option that sets a key of the settings object: no default of its own (None: not given, the settings
    file, the environment or the code's default decide)."""
    return typer.Option(*names, help=help_text, show_default=False)


LogLevel = Annotated[str, typer.Option("--log-level", help="DEBUG, INFO, WARNING or ERROR")]
Settings = Annotated[str | None, setting("settings file, TOML or YAML (docs/configuration.md)", "--config")]
Host = Annotated[str | None, setting("address of the API [default: 127.0.0.1]")]
Port = Annotated[int | None, setting("port of the API [default: 8470]")]
StateDirFlag = Annotated[str | None, setting("where the default state and token live [default: .opsd]")]
TokenFlag = Annotated[
    str | None,
    typer.Option(
        help="bearer token of the mutating endpoints (default: STATE_DIR/token, made once)", show_default=False
    ),
]
HeartbeatFloor = Annotated[float | None, setting("a node is lost after at least this long without heartbeat")]
HangFloor = Annotated[float | None, setting("a run hangs after at least this long without a step")]


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")


@contextlib.contextmanager
def controller_extra(command: str) -> Iterator[None]:
    """Where a command needs the controller's libraries (``opsd[controller]``): one missing (an agent's or a trainer's
    install) is said in one line, exit 2, not a traceback."""
    try:
        yield
    except ModuleNotFoundError as exc:
        typer.echo(
            f"opsd {command}: the controller's libraries are not installed (no module {exc.name!r}):"
            " pip install 'opsd[controller]'",
            err=True,
        )
        raise typer.Exit(2) from None


def _load(section: str, path: str | None, flags: dict[str, Any], defaults: dict[str, Any] | None = None) -> Any:
    try:
        return settings.load(section, path, flags=flags, defaults=defaults)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from None


def agent(
    socket_path: Annotated[str | None, setting("Unix datagram socket ranks send to", "--socket")] = None,
    metrics_host: Annotated[str | None, setting("address of /metrics and /healthz")] = None,
    metrics_port: Annotated[int | None, setting("port of /metrics and /healthz (0: any free port)")] = None,
    node: Annotated[str | None, setting("node name in metrics (default: host name)")] = None,
    gpu_source: Annotated[str | None, setting("GPU health: nvml, none, or file:DIRECTORY (the fake)")] = None,
    gpu_interval_s: Annotated[float | None, setting("seconds between GPU health samples")] = None,
    xid_table: Annotated[str | None, setting("CSV xid,meaning,default_action (default: the table shipped)")] = None,
    controller_url: Annotated[str | None, setting("controller heartbeat endpoint (none: no heartbeats)")] = None,
    controller_token: Annotated[str | None, setting("bearer token for the controller")] = None,
    heartbeat_interval_s: Annotated[float | None, setting("seconds between heartbeats")] = None,
    policy_file: Annotated[str | None, setting("where the ranks read the controller's policy")] = None,
    flight_dir: Annotated[
        str | None,
        setting("where the ranks write Flight Recorder dumps (sent to the controller)"),
    ] = None,
    config: Settings = None,
    log_level: LogLevel = "INFO",
) -> None:
    """Run the node agent: rank reports in, Prometheus metrics out."""
    from opsd_agent.daemon import Agent

    _logging(log_level)
    flags = {
        "socket": socket_path,
        "metrics_host": metrics_host,
        "metrics_port": metrics_port,
        "node": node or None,
        "gpu_source": gpu_source,
        "gpu_interval_s": gpu_interval_s,
        "xid_table": xid_table or None,
        "controller_url": controller_url or None,
        "controller_token": controller_token,
        "heartbeat_interval_s": heartbeat_interval_s,
        "policy_file": policy_file or None,
        "flight_dir": flight_dir or None,
    }
    agent_config = _load("agent", config, flags, defaults={"node": socket.gethostname()})
    daemon = Agent(agent_config)
    try:
        daemon.start()
    except (OSError, OpsError) as exc:
        typer.echo(f"opsd agent: cannot start: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(
        f"opsd agent: datagrams on {agent_config.socket},"
        f" metrics on http://{agent_config.metrics_host}:{daemon.metrics_port}/metrics"
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    daemon.stop()


def serve(
    host: Host = None,
    port: Port = None,
    state_dir: StateDirFlag = None,
    state_url: Annotated[
        str | None,
        typer.Option(
            help="sqlite:///path or postgresql+psycopg://... (default: STATE_DIR/opsd.db)", show_default=False
        ),
    ] = None,
    token: TokenFlag = None,
    tick_interval_s: Annotated[float | None, setting("seconds between failure-detection passes")] = None,
    heartbeat_floor_s: HeartbeatFloor = None,
    hang_floor_s: HangFloor = None,
    backend: Annotated[
        str | None,
        setting(f"what recovers runs: {settings.BACKEND_CHOICES} [default: none]"),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="detect, decide and record every recovery step it would take, and take none (incidents say 'dry"
            " run'; controller.dry_run)",
        ),
    ] = False,
    config: Settings = None,
    log_level: LogLevel = "INFO",
) -> None:
    """Run the controller: the HTTP API for agents and the CLI, failure detection, incidents (OpenAPI at
    /openapi.json, metrics at /metrics); with --backend kubernetes, the recoveries of the cluster's JobSets
    (docs/kubernetes.md)."""
    from opsd.runtime import registry

    _logging(log_level)
    flags = {
        "host": host,
        "port": port,
        "state_dir": state_dir,
        "state_url": state_url,
        "token": token,
        "tick_interval_s": tick_interval_s,
        "detection.heartbeat_floor_s": heartbeat_floor_s,
        "detection.hang_floor_s": hang_floor_s,
        "backend": backend,
        "dry_run": True if dry_run else None,  # not given: the settings decide
    }
    loaded = _load("controller", config, flags)
    chosen = registry.backend(loaded.backend)
    try:
        with controller_extra("serve"):
            chosen.serve(loaded.serve, loaded.section(chosen.name))  # with its section of the settings
    except OpsError as exc:
        typer.echo(f"opsd serve: {exc}", err=True)
        raise typer.Exit(1) from None


#: ``opsd run``'s defaults where they differ from ``opsd serve``'s: local ranks step in seconds, and the liveness
#: datagrams and the heartbeat process of its local agents take any free port (runs side by side on one machine)
RUN_DEFAULTS = {
    "detection.heartbeat_floor_s": 3.0,
    "detection.hang_floor_s": 6.0,
    "liveness_port": 0,
    "heartbeat_port": 0,
}


def run(
    ctx: typer.Context,
    name: Annotated[str, typer.Option("--run", help="the run's name")] = "run",
    nodes: Annotated[int, typer.Option(help="nodes the run uses")] = 2,
    gpus_per_node: Annotated[int, typer.Option(help="rank processes per node")] = 2,
    spares: Annotated[int, typer.Option(help="hot spare nodes")] = 1,
    checkpoint_url: Annotated[
        str, typer.Option(help="where the trainer checkpoints (to tell the step it resumes from)")
    ] = "",
    host: Host = None,
    port: Port = None,
    state_dir: Annotated[str | None, setting("state, token, and the nodes' files [default: .opsd]")] = None,
    token: TokenFlag = None,
    heartbeat_floor_s: Annotated[
        float | None,
        setting("a node is lost after at least this long without heartbeat [default: 3]"),
    ] = None,
    hang_floor_s: Annotated[
        float | None,
        setting("a run hangs after at least this long without a step [default: 6]"),
    ] = None,
    on_no_spare: Annotated[
        OnNoSpare, typer.Option(help="no spare left: wait for one, or shrink (relaunch on fewer nodes)")
    ] = OnNoSpare.WAIT,
    min_nodes: Annotated[int, typer.Option(help="shrink no further than this many nodes")] = 1,
    replica_groups: Annotated[
        int,
        typer.Option(help="fault-tolerant replica groups (torchft, the trainer's --ft): the nodes split evenly"),
    ] = 1,
    min_replicas: Annotated[int, typer.Option(help="the fewest replica groups that keep a quorum")] = 1,
    crash_after_action: Annotated[
        str, typer.Option(hidden=True)
    ] = "",  # fault injection (tests): SIGKILL itself after it
    config: Settings = None,
    log_level: LogLevel = "INFO",
) -> None:
    """Run a training command on local "nodes" with a controller and hot spares: `opsd run --nodes 2
    --gpus-per-node 2 --spares 1 -- python -m examples.train ... --resume`. Failures are detected and recovered
    (swap, relaunch, resume from the newest checkpoint) until every rank exits 0. Run it again with the same --run
    and --state-dir to take up a run whose controller died; SIGINT or SIGTERM stops the run."""
    with controller_extra("run"):
        from opsd.backends.local.spec import LocalRunSpec
        from opsd.runtime.local import run_local

    _logging(log_level)
    flags = {
        "host": host,
        "port": port,
        "state_dir": state_dir,
        "token": token,
        "detection.heartbeat_floor_s": heartbeat_floor_s,
        "detection.hang_floor_s": hang_floor_s,
    }
    serve_config = _load("controller", config, flags, defaults=RUN_DEFAULTS).serve
    try:
        spec = LocalRunSpec(
            run=name,
            command=tuple(ctx.args),
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            spares=spares,
            workdir=f"{serve_config.state_dir}/runs",
            controller_url=f"http://{serve_config.host}:{serve_config.port}/v1/heartbeat",
            checkpoint_url=checkpoint_url,
            on_no_spare=on_no_spare,
            min_nodes=min_nodes,
            crash_after_action=crash_after_action,
            replica_groups=replica_groups,
            min_replicas=min_replicas,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        status = run_local(serve_config, spec, stop=stop)
    except OpsError as exc:
        typer.echo(f"opsd run: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(afterwards(spec.run, serve_config.state_dir, serve_config.state_url), err=True)
    typer.echo(json.dumps({k: status[k] for k in ("run", "state", "step", "ettr")}))
    raise typer.Exit(0 if status["state"] == RunState.COMPLETED else 1)


def afterwards(run: str, state_dir: str, state_url: str) -> str:
    """What to type to read a run's record once ``opsd run`` has exited (no controller needed)."""
    where = f"--state-url {shlex.quote(state_url)}" if state_url else f"--state-dir {shlex.quote(state_dir)}"
    name = shlex.quote(run)
    return "\n".join(
        (
            f"run {run} is over; its record stays in the state store, readable without a controller:",
            f"  opsd incidents {name} {where}",
            f"  opsd postmortem {name} {where} --format html --out {shlex.quote(run + '-postmortem.html')}",
            f"  opsd flamegraph {name} {where}",
        )
    )


def register(app: typer.Typer) -> None:
    app.command()(agent)
    app.command()(serve)
    app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(run)
