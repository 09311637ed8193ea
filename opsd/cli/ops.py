"""The operator's commands of the ``opsd`` CLI: they talk to the controller's API.

Where the controller is: ``--url``, else ``$OPSD_URL``, else ``url`` in the config file (``--config``,
``$OPSD_CONFIG`` or ``~/.config/opsd/config.toml``), else http://127.0.0.1:8470. The token likewise (``--token``,
``$OPSD_TOKEN``, ``token`` in the config file), else the file ``token`` in the state directory that ``opsd
serve`` / ``opsd run`` write.

Exit codes: 0 done; 1 the controller refused, failed or could not be reached (the reason on stderr); 2 a bad
command line or config file; 3 ``restart --wait`` gave up waiting (the restart goes on).
"""

from __future__ import annotations

import json
import time
import tomllib
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from opsd.cli.client import ApiClient
from opsd.errors import OpsError

DEFAULT_URL = "http://127.0.0.1:8470"
EXIT_ERROR, EXIT_USAGE, EXIT_TIMEOUT = 1, 2, 3

URL = typer.Option(None, "--url", envvar="OPSD_URL", help="the controller (default: config file, then localhost)")
TOKEN = typer.Option(None, "--token", envvar="OPSD_TOKEN", help="bearer token (default: config file, STATE_DIR/token)")
STATE = typer.Option(".opsd", "--state-dir", envvar="OPSD_STATE_DIR", help="where the token file is")
CONFIG = typer.Option(None, "--config", envvar="OPSD_CONFIG", help="TOML with url and token")
JSON = typer.Option(False, "--json", help="print JSON instead of a table")


def config_file(path: str | None) -> dict[str, str]:
    """``url`` and ``token`` from the config file; a missing default file is no error, a bad one is."""
    chosen = Path(path) if path else Path.home() / ".config" / "opsd" / "config.toml"
    if not chosen.exists():
        if path:
            fail(f"config file {chosen} does not exist", EXIT_USAGE)
        return {}
    try:
        doc = tomllib.loads(chosen.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        fail(f"config file {chosen}: {exc}", EXIT_USAGE)
    unknown = set(doc) - {"url", "token"}
    bad = [k for k in ("url", "token") if k in doc and not isinstance(doc[k], str)]
    if unknown or bad:
        fail(f"config file {chosen}: keys are url and token (strings); got {sorted(unknown | set(bad))}", EXIT_USAGE)
    return {str(k): str(v) for k, v in doc.items()}


def client(url: str | None, token: str | None, state_dir: str, config: str | None) -> ApiClient:
    found = config_file(config) if url is None or token is None else {}
    try:
        return ApiClient(url or found.get("url") or DEFAULT_URL, token or found.get("token") or None, state_dir)
    except OpsError as exc:
        fail(str(exc), EXIT_USAGE)


def fail(message: str, code: int = EXIT_ERROR) -> NoReturn:
    typer.echo(f"opsd: {message}", err=True)
    raise typer.Exit(code)


def call(api: ApiClient, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    try:
        return api.post(path, body) if method == "POST" else api.get(path)
    except OpsError as exc:
        fail(str(exc))


def show(body: Any, as_json: bool, table: Callable[[Any], Table]) -> None:
    if as_json:
        typer.echo(json.dumps(body))
    else:
        Console().print(table(body))


def when(unix_s: float | None) -> str:
    if unix_s is None:
        return "-"
    return datetime.fromtimestamp(unix_s, UTC).strftime("%Y-%m-%d %H:%M:%S")


def size(nbytes: float | None) -> str:
    if nbytes is None:
        return "-"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(nbytes)


def seconds(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


# -- tables ----------------------------------------------------------------------------------------------------
def runs_table(body: list[dict[str, Any]]) -> Table:
    table = Table(title="runs")
    for column in ("run", "state", "launch", "step", "started (UTC)", "updated (UTC)"):
        table.add_column(column, no_wrap=True)
    for r in body:
        table.add_row(
            r["id"], r["state"], str(r["generation"]), str(r["last_step"]), when(r["created_s"]), when(r["updated_s"])
        )
    return table


def status_table(body: dict[str, Any]) -> Table:
    table = Table(title=f"run {body['run']}", show_header=False)
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
    return table


def statuses_table(body: list[dict[str, Any]]) -> Table:
    table = Table(title="runs")
    for column in ("run", "state", "step", "ranks", "MFU", "tokens/s", "ETTR", "spares", "stragglers", "open"):
        table.add_column(column, no_wrap=True)
    for s in body:
        table.add_row(
            s["run"],
            s["state"],
            str(s["step"]),
            str(s["ranks"]),
            f"{s['mfu_ratio']:.3f}",
            f"{s['tokens_per_s']:.0f}",
            f"{s['ettr']:.3f}",
            str(s["spares_available"]),
            str(len(s["stragglers"])),
            str(s["open_incidents"]),
        )
    return table


def incidents_table(body: list[dict[str, Any]]) -> Table:
    table = Table(title="incidents")
    columns = ("id", "run", "kind", "node", "rank", "state", "detected after s", "recovered after s", "lost steps")
    for column in columns:
        table.add_column(column, no_wrap=True)
    table.add_column("detail", overflow="fold")
    for i in body:
        table.add_row(
            str(i["id"]),
            i["run"],
            i["kind"],
            i["node"] or "-",
            "-" if i["rank"] is None else str(i["rank"]),
            i["state"],
            f"{i['detected_s'] - i['failed_s']:.1f}",
            f"{i['resumed_s'] - i['detected_s']:.1f}" if i["resumed_s"] else "-",
            "-" if i["lost_steps"] is None else str(i["lost_steps"]),
            i["detail"],
        )
    return table


def spares_table(body: dict[str, Any]) -> Table:
    table = Table(title="spare pools")
    for column in ("run", "active nodes", "spares (health)", "usable", "recommended", "cordoned"):
        table.add_column(column, no_wrap=True)
    table.add_column("why", overflow="fold")
    for r in body["runs"]:
        table.add_row(
            r["run"],
            str(r["active_nodes"]),
            ", ".join(f"{s['name']} ({s['health']})" for s in r["spares"]) or "none",
            str(r["available"]),
            str(r["recommended"]),
            ", ".join(c["name"] for c in r["cordoned"]) or "-",
            r["why"],
        )
    return table


def checkpoints_table(body: dict[str, Any]) -> Table:
    table = Table(title=f"checkpoints of {body['run']} ({body['url'] or 'no store'})")
    for column in ("step", "state", "size", "committed (UTC)", "blocking s", "save s"):
        table.add_column(column, no_wrap=True)
    table.add_column("problem", overflow="fold")
    for c in body["checkpoints"]:
        table.add_row(
            str(c["step"]),
            c["state"],
            size(c["bytes"]),
            when(c["time_unix_s"]),
            seconds(c["blocking_s"], 3),
            seconds(c["save_s"], 2),
            c["problem"] or "",
        )
    return table


def cadence_table(body: dict[str, Any]) -> Table:
    table = Table(title=f"checkpoint cadence of {body['run']}", show_header=False)
    cadence = body["cadence"]
    rows = [
        ("cadence", f"every {cadence['every_steps']} steps from step {cadence['from_step']}" if cadence else "-"),
        ("every (s)", seconds(cadence["every_s"]) if cadence else "-"),
        ("run MTBF (s)", seconds(body["mtbf_s"], 0)),
        ("node MTBF (h)", f"{body['node_mtbf_h']:,.0f}"),
        ("failures / node-hours", f"{body['failures']} / {body['node_hours']:,.2f}"),
        ("checkpoint cost (s)", seconds(body["checkpoint_cost_s"], 3)),
        ("step time (s)", seconds(body["step_s"], 3)),
        ("Young / Daly interval (s)", f"{seconds(body['young_interval_s'])} / {seconds(body['daly_interval_s'])}"),
        ("why", body["why"]),
    ]
    for key, value in rows:
        table.add_row(key, value)
    return table


# -- commands --------------------------------------------------------------------------------------------------
def runs(
    as_json: bool = JSON, url: str = URL, token: str = TOKEN, state_dir: str = STATE, config: str = CONFIG
) -> None:
    """The runs the controller knows."""
    show(call(client(url, token, state_dir, config), "GET", "/v1/runs"), as_json, runs_table)


def status(
    run: str = typer.Argument(None, help="the run (default: every run)"),
    as_json: bool = JSON,
    url: str = URL,
    token: str = TOKEN,
    state_dir: str = STATE,
    config: str = CONFIG,
) -> None:
    """A run's state: step, MFU, tokens/s, ETTR, cadence, nodes, spares, stragglers (every run's without RUN)."""
    api = client(url, token, state_dir, config)
    if run is not None:
        show(call(api, "GET", f"/v1/runs/{run}"), as_json, status_table)
        return
    every = [call(api, "GET", f"/v1/runs/{r['id']}") for r in call(api, "GET", "/v1/runs")]
    show(every, as_json, statuses_table)


def incidents(
    run: str = typer.Argument(None, help="the run (default: every run)"),
    as_json: bool = JSON,
    url: str = URL,
    token: str = TOKEN,
    state_dir: str = STATE,
    config: str = CONFIG,
) -> None:
    """Incidents, oldest first: kind, node, rank, detection and recovery times, lost steps."""
    path = f"/v1/runs/{run}/incidents" if run is not None else "/v1/incidents"
    show(call(client(url, token, state_dir, config), "GET", path), as_json, incidents_table)


def restart(
    run: str = typer.Argument(..., help="the run"),
    reason: str = typer.Option(..., "--reason", help="why (kept in the incident history)"),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="wait until the ranks train again"),
    timeout_s: float = typer.Option(600.0, "--timeout-s", min=1.0, help="how long to wait"),
    as_json: bool = JSON,
    url: str = URL,
    token: str = TOKEN,
    state_dir: str = STATE,
    config: str = CONFIG,
) -> None:
    """Restart every rank of a running run, gracefully: a checkpoint first when the ranks progress, then stop and
    relaunch from the newest checkpoint. Exit 3: still restarting after --timeout-s."""
    api = client(url, token, state_dir, config)
    incident = call(api, "POST", f"/v1/runs/{run}/restart", {"reason": reason})
    if wait:
        incident = _follow(api, run, int(incident["id"]), timeout_s, quiet=as_json)
    actions = [a for a in call(api, "GET", f"/v1/runs/{run}/actions") if a["incident_id"] == incident["id"]]
    if as_json:
        typer.echo(json.dumps({"incident": incident, "actions": actions}))
    else:
        saved: dict[str, Any] = next((a["result"] for a in actions if a["kind"] == "checkpoint" and a["result"]), {})
        step = saved.get("checkpoint_step")
        typer.echo(
            f"run {run}: incident {incident['id']} {incident['state']};"
            f" checkpoint {'at step ' + str(step) if step is not None else 'skipped (' + saved.get('why', '-') + ')'};"
            f" resumed from step {incident['resumed_from_step'] if incident['resumed_from_step'] is not None else '-'}"
        )
    if wait and incident["state"] == "open":
        raise typer.Exit(EXIT_TIMEOUT)


def _follow(api: ApiClient, run: str, incident_id: int, timeout_s: float, quiet: bool) -> dict[str, Any]:
    """Poll the incident and its actions until the ranks train again (or ``timeout_s``), with a progress display."""
    deadline = time.monotonic() + timeout_s
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), disable=quiet, transient=False) as progress:
        task = progress.add_task(f"restarting {run}", total=None)
        while True:
            found = [i for i in call(api, "GET", f"/v1/runs/{run}/incidents") if i["id"] == incident_id]
            if not found:
                fail(f"incident {incident_id} of run {run} disappeared")
            incident: dict[str, Any] = found[0]
            done = [a["kind"] for a in call(api, "GET", f"/v1/runs/{run}/actions") if a["incident_id"] == incident_id]
            state = "training again" if incident["state"] != "open" else (f"done: {', '.join(done)}" if done else "")
            progress.update(task, description=f"restarting {run}: {state or 'asked'}")
            if incident["state"] != "open" or time.monotonic() >= deadline:
                return incident
            time.sleep(0.5)


def cordon(
    node: str = typer.Argument(..., help="the node"),
    reason: str = typer.Option(..., "--reason", help="why (shown in status and spares)"),
    url: str = URL,
    token: str = TOKEN,
    state_dir: str = STATE,
    config: str = CONFIG,
) -> None:
    """Take a node out of service: it is neither used nor chosen as a spare until uncordoned."""
    body = call(client(url, token, state_dir, config), "POST", f"/v1/nodes/{node}/cordon", {"reason": reason})
    typer.echo(f"{body['name']}: {body['role']}")


def uncordon(
    node: str = typer.Argument(..., help="the node"),
    url: str = URL,
    token: str = TOKEN,
    state_dir: str = STATE,
    config: str = CONFIG,
) -> None:
    """Put a node back in its run's spare pool (a run waiting for a spare takes it)."""
    body = call(client(url, token, state_dir, config), "POST", f"/v1/nodes/{node}/uncordon")
    typer.echo(f"{body['name']}: {body['role']}")


def spares(
    as_json: bool = JSON, url: str = URL, token: str = TOKEN, state_dir: str = STATE, config: str = CONFIG
) -> None:
    """Each run's spare pool: the spares and their health, and the recommended pool size with its reason."""
    show(call(client(url, token, state_dir, config), "GET", "/v1/spares"), as_json, spares_table)


def checkpoints(
    run: str = typer.Argument(..., help="the run"),
    as_json: bool = JSON,
    url: str = URL,
    token: str = TOKEN,
    state_dir: str = STATE,
    config: str = CONFIG,
) -> None:
    """A run's checkpoints, newest first: committed or torn (and why), size, commit time, blocking seconds."""
    show(call(client(url, token, state_dir, config), "GET", f"/v1/runs/{run}/checkpoints"), as_json, checkpoints_table)


def cadence(
    run: str = typer.Argument(..., help="the run"),
    as_json: bool = JSON,
    url: str = URL,
    token: str = TOKEN,
    state_dir: str = STATE,
    config: str = CONFIG,
) -> None:
    """A run's checkpoint cadence and why: MTBF estimate, checkpoint cost, step time, Young's and Daly's interval."""
    show(call(client(url, token, state_dir, config), "GET", f"/v1/runs/{run}/cadence"), as_json, cadence_table)


def postmortem(
    run: str = typer.Argument(..., help="the run"),
    incident: int = typer.Argument(None, help="one incident's id (default: the whole run)"),
    output_format: str = typer.Option("md", "--format", help="md (Markdown) or html (one self-contained page)"),
    out: str = typer.Option("", "--out", help="write here (default: standard output)"),
    as_json: bool = typer.Option(False, "--json", help="print the controller's bundle instead (the report's data)"),
    url: str = URL,
    token: str = TOKEN,
    state_dir: str = STATE,
    config: str = CONFIG,
) -> None:
    """The post-mortem of a run or of one incident: timeline, root cause, lost work and badput, ETTR, the checkpoint
    resumed from and why, stragglers, Flight Recorder culprits (docs/postmortem.md)."""
    from opsd.postmortem.report import build, to_html, to_markdown

    if output_format not in ("md", "html"):
        fail(f"--format must be md or html, not {output_format!r}", EXIT_USAGE)
    api = client(url, token, state_dir, config)
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True, disable=as_json) as progress:
        task = progress.add_task(f"fetching the post-mortem of {run}", total=None)
        bundle = call(api, "GET", f"/v1/runs/{run}/postmortem")
        if as_json:
            typer.echo(json.dumps(bundle))
            return
        progress.update(task, description="rendering" + (" the plots" if output_format == "html" else ""))
        try:
            report = build(bundle, incident)
            text = to_html(report) if output_format == "html" else to_markdown(report)
        except OpsError as exc:
            fail(str(exc))
    _write(text, out)


def flamegraph(
    run: str = typer.Argument(..., help="the run"),
    out: str = typer.Option("", "--out", help="the SVG flame graph to write (default: RUN-collectives.svg)"),
    folded: str = typer.Option("", "--folded", help="also write the folded stacks here ('-': standard output)"),
    as_json: bool = typer.Option(False, "--json", help="print the stacks as JSON instead of writing an SVG"),
    url: str = URL,
    token: str = TOKEN,
    state_dir: str = STATE,
    config: str = CONFIG,
) -> None:
    """Where a run's collective time went, as a flame graph: step;phase;dimension;op stacks weighted by
    microseconds, summed over every rank (docs/flamegraph.md). The folded stacks also suit flamegraph.pl,
    inferno and speedscope."""
    from opsd.analysis.flamegraph import parse_folded, render_svg

    api = client(url, token, state_dir, config)
    try:
        text = api.get_text(f"/v1/runs/{run}/flamegraph")
        stacks = parse_folded(text)
    except OpsError as exc:
        fail(str(exc))
    if as_json:
        typer.echo(json.dumps([{"stack": list(k), "us": v} for k, v in sorted(stacks.items(), key=lambda kv: -kv[1])]))
        return
    if folded:
        _write(text, "" if folded == "-" else folded)
    if not stacks:
        fail(f"run {run} has no collective time recorded yet")
    target = out or f"{run}-collectives.svg"
    _write(render_svg(stacks, title=f"collectives of {run}"), target)
    if folded != "-":
        typer.echo(f"{target}: {len(stacks)} stacks")


def _write(text: str, path: str) -> None:
    if not path:
        typer.echo(text, nl=not text.endswith("\n"))
        return
    try:
        Path(path).write_text(text)
    except OSError as exc:
        fail(f"cannot write {path}: {exc}")


def register(app: typer.Typer) -> None:
    commands = (
        runs,
        status,
        incidents,
        restart,
        cordon,
        uncordon,
        spares,
        checkpoints,
        cadence,
        postmortem,
        flamegraph,
    )
    for command in commands:
        app.command(command.__name__)(command)
