"""The operator's commands of the ``opsd`` CLI: they talk to the controller's API (``opsd.cli.connection``) and show
its answers as tables (``opsd.cli.tables``) or JSON."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from functools import partial
from typing import Annotated, Any

import msgspec
import typer
from rich.console import Console, RenderableType
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from opsd.cli import tables
from opsd.cli.client import ApiClient
from opsd.cli.columns import echo
from opsd.cli.connection import (
    EXIT_TIMEOUT,
    EXIT_USAGE,
    AsJson,
    RunName,
    Wide,
    call,
    connected,
    fail,
    read,
    typed,
    write,
)
from opsd.controller.port import FaultKind
from opsd.errors import OpsError
from opsd.protocol.answers import CadenceView, Checkpoints, MaintenanceWindow, RunStatus, SparePools, WindowEnded
from opsd.protocol.bundle import RunSummary
from opsd.protocol.records import Action, IncidentRow, NodeRow
from opsd.protocol.states import ActionKind, IncidentState
from opsd.protocol.steps import CheckpointTaken

Run = Annotated[str, typer.Argument(help="the run")]
AnyRun = Annotated[str | None, typer.Argument(help="the run (default: every run)")]
Node = Annotated[str, typer.Argument(help="the node")]
Reason = Annotated[str, typer.Option("--reason", help="why (kept in the incident history)")]
IncidentId = Annotated[int | None, typer.Argument(help="one incident's id: it in full, with its actions")]


def display(body: Any, as_json: bool, render: Callable[[Any], RenderableType]) -> None:
    """The API's answer as JSON, or rendered as a table."""
    if as_json:
        typer.echo(json.dumps(msgspec.to_builtins(body)))
    else:
        echo(render(body))


runs_app = typer.Typer(help="The runs the controller knows; `opsd runs attach` makes a JobSet a run.")


@runs_app.callback(invoke_without_command=True)
@connected
def runs(ctx: typer.Context, as_json: AsJson = False, wide: Wide = False, *, api: ApiClient) -> None:
    """The runs the controller knows."""
    if ctx.invoked_subcommand is None:
        display(read(api, "/v1/runs", RUNS, "runs"), as_json, partial(tables.runs_table, wide=wide))


@runs_app.command("attach")
@connected
def runs_attach(
    target: Annotated[
        str, typer.Argument(help="the job, in the backend's words: NAMESPACE/JOBSET for a JobSet on Kubernetes")
    ],
    name: Annotated[str, typer.Option("--name", help="the run's name (default: the backend's, the JobSet's)")] = "",
    as_json: AsJson = False,
    *,
    api: ApiClient,
) -> None:
    """Make a job a run of this controller (Kubernetes backend: a JobSet).

    As the opsd.io/run annotation does, for a JobSet its users cannot edit (a Kubeflow TrainJob's)."""
    if not target.strip():
        fail("attach: a target is needed (NAMESPACE/JOBSET)", EXIT_USAGE)
    answer = call(api, "POST", "/v1/runs/attach", {"target": target, "run": name})
    run = typed(answer, RunSummary, "the attached run")
    if as_json:
        typer.echo(json.dumps(answer))
    else:
        typer.echo(f"run {run.id}: {target} attached")


@connected
def status(run: AnyRun = None, as_json: AsJson = False, wide: Wide = False, *, api: ApiClient) -> None:
    """A run's state: step, MFU, tokens/s, ETTR, cadence, nodes, spares, stragglers (every run's without RUN)."""
    if run is not None:
        display(read(api, f"/v1/runs/{run}", RunStatus, "run status"), as_json, partial(tables.status_table, wide=wide))
        return
    every = [read(api, f"/v1/runs/{r.id}", RunStatus, "run status") for r in read(api, "/v1/runs", RUNS, "runs")]
    display(every, as_json, partial(tables.statuses_table, wide=wide))


@connected
def incidents(
    run: AnyRun = None, incident: IncidentId = None, as_json: AsJson = False, wide: Wide = False, *, api: ApiClient
) -> None:
    """Incidents, oldest first: kind, state, detail (--wide: node, rank, detection and recovery times, lost steps).
    With RUN and ID: that incident in full, with its actions and their results."""
    if run is None:
        display(read(api, "/v1/incidents", INCIDENTS, "incidents"), as_json, partial(tables.incidents_table, wide=wide))
        return
    found = read(api, f"/v1/runs/{run}/incidents", INCIDENTS, "incidents")
    if incident is None:
        display(found, as_json, partial(tables.incidents_table, wide=wide, run=run))
        return
    chosen = next((i for i in found if i.id == incident), None)
    if chosen is None:
        fail(f"run {run} has no incident {incident} (`opsd incidents {run}` lists them)")
    actions = _actions_of(api, run, incident)
    body = {"incident": chosen, "actions": actions}
    display(body, as_json, lambda _: tables.incident_view(chosen, actions, wide=wide))


RUNS, INCIDENTS, ACTIONS = tuple[RunSummary, ...], tuple[IncidentRow, ...], tuple[Action, ...]


def _actions_of(api: ApiClient, run: str, incident_id: int) -> list[Action]:
    """The actions of one incident of ``run``, in their order."""
    return [a for a in read(api, f"/v1/runs/{run}/actions", ACTIONS, "actions") if a.incident_id == incident_id]


@connected
def restart(
    run: Run,
    reason: Reason,
    wait: Annotated[bool, typer.Option("--wait/--no-wait", help="wait until the ranks train again")] = True,
    timeout_s: Annotated[float, typer.Option("--timeout-s", min=1.0, help="how long to wait")] = 600.0,
    as_json: AsJson = False,
    *,
    api: ApiClient,
) -> None:
    """Restart every rank of a running run, gracefully: a checkpoint first when the ranks progress, then stop and
    relaunch from the newest checkpoint. Exit 3: still restarting after --timeout-s."""
    asked = typed(
        call(api, "POST", f"/v1/runs/{run}/restart", {"reason": reason}), IncidentRow, "the restart's incident"
    )
    incident = _follow(api, run, asked.id, timeout_s, quiet=as_json) if wait else asked
    actions = _actions_of(api, run, incident.id)
    if as_json:
        typer.echo(json.dumps(msgspec.to_builtins({"incident": incident, "actions": actions})))
    else:
        saved = next((a.outcome for a in actions if a.kind == ActionKind.CHECKPOINT and a.result), None)
        taken = saved if isinstance(saved, CheckpointTaken) else CheckpointTaken(checkpoint_step=None, why="-")
        step = taken.checkpoint_step
        resumed = incident.resumed_from_step
        typer.echo(
            f"run {run}: incident {incident.id} {incident.state};"
            f" checkpoint {'at step ' + str(step) if step is not None else 'skipped (' + (taken.why or '-') + ')'};"
            f" resumed from step {resumed if resumed is not None else '-'}"
        )
    if wait and incident.state == IncidentState.OPEN:
        raise typer.Exit(EXIT_TIMEOUT)


def _follow(api: ApiClient, run: str, incident_id: int, timeout_s: float, quiet: bool) -> IncidentRow:
    """Poll the incident and its actions until the ranks train again (or ``timeout_s``), with a progress display."""
    deadline = time.monotonic() + timeout_s
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), disable=quiet, transient=False) as progress:
        task = progress.add_task(f"restarting {run}", total=None)
        while True:
            found = [i for i in read(api, f"/v1/runs/{run}/incidents", INCIDENTS, "incidents") if i.id == incident_id]
            if not found:
                fail(f"incident {incident_id} of run {run} disappeared")
            incident = found[0]
            done = [a.kind for a in _actions_of(api, run, incident_id)]
            open_ = incident.state == IncidentState.OPEN
            state = "training again" if not open_ else (f"done: {', '.join(done)}" if done else "")
            progress.update(task, description=f"restarting {run}: {state or 'asked'}")
            if not open_ or time.monotonic() >= deadline:
                return incident
            time.sleep(0.5)


@connected
def cordon(
    node: Node,
    reason: Annotated[str, typer.Option("--reason", help="why (shown in status and spares)")],
    *,
    api: ApiClient,
) -> None:
    """Take a node out of service: it is neither used nor chosen as a spare until uncordoned."""
    done = typed(call(api, "POST", f"/v1/nodes/{node}/cordon", {"reason": reason}), NodeRow, "the node")
    typer.echo(f"{done.name}: {done.role}")


@connected
def uncordon(node: Node, *, api: ApiClient) -> None:
    """Put a node back in its run's spare pool (a run waiting for a spare takes it)."""
    done = typed(call(api, "POST", f"/v1/nodes/{node}/uncordon"), NodeRow, "the node")
    typer.echo(f"{done.name}: {done.role}")


@connected
def spares(as_json: AsJson = False, wide: Wide = False, *, api: ApiClient) -> None:
    """Each run's spare pool: its spares by health, usable and recommended counts (--wide: each spare, the cordoned
    nodes, and why that many)."""
    display(read(api, "/v1/spares", SparePools, "spare pools"), as_json, partial(tables.spares_table, wide=wide))


@connected
def checkpoints(run: Run, as_json: AsJson = False, wide: Wide = False, *, api: ApiClient) -> None:
    """A run's checkpoints, newest first: committed or torn (and why), size, commit time (--wide: blocking and save
    seconds)."""
    answer = read(api, f"/v1/runs/{run}/checkpoints", Checkpoints, "checkpoints")
    display(answer, as_json, partial(tables.checkpoints_table, wide=wide))


@connected
def cadence(run: Run, as_json: AsJson = False, wide: Wide = False, *, api: ApiClient) -> None:
    """A run's checkpoint cadence and why: MTBF estimate, checkpoint cost, step time, Young's and Daly's interval."""
    answer = read(api, f"/v1/runs/{run}/cadence", CadenceView, "checkpoint cadence")
    display(answer, as_json, partial(tables.cadence_table, wide=wide))


@connected
def postmortem(
    run: Run,
    incident: Annotated[int | None, typer.Argument(help="one incident's id (default: the whole run)")] = None,
    output_format: Annotated[
        str, typer.Option("--format", help="md (Markdown) or html (one self-contained page)")
    ] = "md",
    out: Annotated[str, typer.Option("--out", help="write here (default: standard output)")] = "",
    as_json: Annotated[
        bool, typer.Option("--json", help="print the controller's bundle instead (the report's data)")
    ] = False,
    *,
    api: ApiClient,
) -> None:
    """The post-mortem of a run or of one incident: timeline, root cause, lost work and badput, ETTR, the checkpoint
    resumed from and why, stragglers, Flight Recorder culprits (docs/postmortem.md)."""
    from opsd.postmortem.build import build
    from opsd.postmortem.render import to_html, to_markdown

    if output_format not in ("md", "html"):
        fail(f"--format must be md or html, not {output_format!r}", EXIT_USAGE)
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True, disable=as_json) as progress:
        task = progress.add_task(f"fetching the post-mortem of {run}", total=None)
        bundle = call(api, "GET", f"/v1/runs/{run}/postmortem")  # decoded as opsd.protocol.bundle's, by build
        if as_json:
            typer.echo(json.dumps(bundle))
            return
        progress.update(task, description="rendering" + (" the plots" if output_format == "html" else ""))
        try:
            report = build(bundle, incident)
            text = to_html(report) if output_format == "html" else to_markdown(report)
        except OpsError as exc:
            fail(str(exc))
    write(text, out)


@connected
def flamegraph(
    run: Run,
    out: Annotated[str, typer.Option("--out", help="the SVG flame graph to write (default: RUN-collectives.svg)")] = "",
    folded: Annotated[
        str, typer.Option("--folded", help="also write the folded stacks here ('-': standard output)")
    ] = "",
    as_json: Annotated[bool, typer.Option("--json", help="print the stacks as JSON instead of writing an SVG")] = False,
    launch: Annotated[int | None, typer.Option("--launch", min=1, help="one launch (default: every launch)")] = None,
    *,
    api: ApiClient,
) -> None:
    """Where a run's collective time went, as a flame graph: step;phase;dimension;op stacks weighted by
    microseconds, summed over every rank (docs/flamegraph.md), of every launch or of one. The folded stacks also
    suit flamegraph.pl, inferno and speedscope."""
    from opsd.analysis.flamegraph import parse_folded, render_svg

    try:
        text = api.get_text(f"/v1/runs/{run}/flamegraph" + (f"?launch={launch}" if launch is not None else ""))
        stacks = parse_folded(text)
    except OpsError as exc:
        fail(str(exc))
    if as_json:
        typer.echo(json.dumps([{"stack": list(k), "us": v} for k, v in sorted(stacks.items(), key=lambda kv: -kv[1])]))
        return
    if folded:
        write(text, "" if folded == "-" else folded)
    of = f" of launch {launch}" if launch is not None else ""
    if not stacks:
        fail(f"run {run} has no collective time recorded{of} yet")
    target = out or f"{run}-collectives.svg"
    write(render_svg(stacks, title=f"collectives of {run}{of}"), target)
    if folded != "-":
        typer.echo(f"{target}: {len(stacks)} stacks")


maintenance_app = typer.Typer(
    help="Maintenance windows: while one holds a run (or every run), incidents are recorded and nothing is recovered.",
    no_args_is_help=True,
)
RunOrEvery = Annotated[str | None, typer.Option("--run", help="the run (default: every run)", show_default=False)]


@maintenance_app.command("start")
@connected
def maintenance_start(
    run: RunOrEvery = None,
    reason: Annotated[str, typer.Option("--reason", help="why (shown in status)")] = "maintenance",
    *,
    api: ApiClient,
) -> None:
    """Hold the recoveries of a run, or of every run: detection and records go on."""
    answer = call(api, "POST", "/v1/maintenance/start", {"run": run, "reason": reason})
    window = typed(answer, MaintenanceWindow, "the window started")
    typer.echo(f"maintenance: {window.run or 'every run'} held since {window.since_s:.0f} ({window.reason})")


@maintenance_app.command("stop")
@connected
def maintenance_stop(run: RunOrEvery = None, *, api: ApiClient) -> None:
    """End a window: the recoveries it held start at the next detection pass."""
    ended = typed(call(api, "POST", "/v1/maintenance/stop", {"run": run}), WindowEnded, "the window ended")
    typer.echo(f"maintenance: {ended.run or 'every run'} {'released' if ended.ended else 'was not held'}")


@maintenance_app.command("list")
@connected
def maintenance_list(as_json: AsJson = False, *, api: ApiClient) -> None:
    """The windows in force."""
    windows = call(api, "GET", "/v1/maintenance")
    if as_json:
        typer.echo(json.dumps(windows))
        return
    for w in windows:
        typer.echo(f"{w['run'] or 'every run'}: held since {w['since_s']:.0f} ({w['reason']})")


inject_app = typer.Typer(help="Inject a fault into a run of `opsd run` (local mode).", no_args_is_help=True)
Rank = Annotated[int, typer.Option(help="the rank")]


def _inject(api: ApiClient, run: str, body: dict[str, object]) -> None:
    typer.echo(call(api, "POST", f"/v1/runs/{run}/inject", body)["injected"])


@inject_app.command("xid")
@connected
def inject_xid(
    node: Annotated[str, typer.Option(help="the node")],
    gpu: Annotated[int, typer.Option(help="the GPU index")] = 0,
    xid: Annotated[int, typer.Option(help="the XID code")] = 79,
    run: RunName = "run",
    *,
    api: ApiClient,
) -> None:
    """An XID event on a node's GPU (written into its GPU source)."""
    _inject(api, run, {"fault": FaultKind.XID, "node": node, "gpu": gpu, "xid": xid})


@inject_app.command("kill")
@connected
def inject_kill(rank: Rank, run: RunName = "run", *, api: ApiClient) -> None:
    """SIGKILL a rank process."""
    _inject(api, run, {"fault": FaultKind.KILL, "rank": rank})


@inject_app.command("hang")
@connected
def inject_hang(rank: Rank, run: RunName = "run", *, api: ApiClient) -> None:
    """SIGSTOP a rank process: the others wait for it in their next collective."""
    _inject(api, run, {"fault": FaultKind.HANG, "rank": rank})


@inject_app.command("slow")
@connected
def inject_slow(
    rank: Rank,
    factor: Annotated[float, typer.Option(help="how many times slower")] = 1.3,
    run: RunName = "run",
    *,
    api: ApiClient,
) -> None:
    """Slow a rank down by a factor (SIGSTOP/SIGCONT duty cycle)."""
    _inject(api, run, {"fault": FaultKind.SLOW, "rank": rank, "factor": factor})


drill_app = typer.Typer(
    help="Rehearse a failure on a real cluster, where none can be made: opsd recovers from it as from a real one.",
    no_args_is_help=True,
)


@drill_app.command("xid")
@connected
def drill_xid(
    run: Run,
    node: Annotated[str, typer.Option(help="one of the run's active nodes")],
    gpu: Annotated[int, typer.Option(min=0, help="the GPU index named in the incident")] = 0,
    xid: Annotated[int, typer.Option(min=1, help="the XID code named in the incident")] = 79,
    as_json: AsJson = False,
    *,
    api: ApiClient,
) -> None:
    """A fatal XID on NODE of a running RUN, rehearsed: the node is quarantined, a spare takes its place and the run
    resumes from its newest checkpoint, as after a GPU that fell off the bus; the incident says "drill". Follow it
    with `opsd incidents RUN` and `opsd postmortem RUN`; give the node back with `opsd uncordon NODE`."""
    answer = call(api, "POST", f"/v1/runs/{run}/drill", {"node": node, "gpu": gpu, "xid": xid})
    incident = typed(answer, IncidentRow, "the drill's incident")
    if as_json:
        typer.echo(json.dumps(answer))
        return
    typer.echo(
        f"run {run}: incident {incident.id} ({incident.kind} on {node}, a drill): {incident.state};"
        f" follow it with `opsd incidents {run}`, give {node} back with `opsd uncordon {node}` after"
    )


COMMANDS = (status, incidents, restart, cordon, uncordon, spares, checkpoints, cadence, postmortem, flamegraph)


def register(app: typer.Typer) -> None:
    for command in COMMANDS:
        app.command(command.__name__)(command)
    app.add_typer(runs_app, name="runs")
    app.add_typer(inject_app, name="inject")
    app.add_typer(drill_app, name="drill")
    app.add_typer(maintenance_app, name="maintenance")
