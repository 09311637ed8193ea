"""The operator commands' tables of what the controller answers (laid out by ``opsd.cli.columns``).

Without ``--wide`` each listing leaves out its secondary columns so that it reads in 80 columns; ``--wide`` adds
them. ``opsd incidents RUN ID`` shows one incident in full, with its actions."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Literal

import msgspec
from rich.console import Group
from rich.text import Text

from opsd.cli.columns import Col, Fit, Grid, fields, lines, listing, number, pairs, seconds, size, when
from opsd.protocol.answers import (
    CadencePlan,
    CadenceView,
    CheckpointEntry,
    Checkpoints,
    NodeEntry,
    PipelineBubble,
    PlannedCadence,
    PoolNode,
    PreviousCadence,
    RunPool,
    RunStatus,
    SparePools,
)
from opsd.protocol.bundle import RunSummary
from opsd.protocol.records import Action, IncidentRow
from opsd.protocol.states import NodeRole

ROLES = tuple(NodeRole)  # the order of the nodes' roles in a run's status
IN_FULL = "left out for want of room: opsd incidents RUN ID shows it"

RUNS: tuple[Col[RunSummary], ...] = (
    Col("run", lambda r: r.id),
    Col("state", lambda r: r.state or "-"),
    Col("launch", lambda r: number(r.generation), shown="wide"),
    Col("step", lambda r: number(r.last_step)),
    Col("started (UTC)", lambda r: when(r.created_s), shown="wide"),
    Col("updated (UTC)", lambda r: when(r.updated_s)),
)

STATUSES: tuple[Col[RunStatus], ...] = (
    Col("run", lambda s: s.run),
    Col("state", lambda s: s.state),
    Col("step", lambda s: str(s.step)),
    Col("ranks", lambda s: str(s.ranks), shown="wide"),
    Col("MFU", lambda s: measured(s, "mfu_ratio", ".3f", short=True), shown="wide"),
    Col("tokens/s", lambda s: measured(s, "tokens_per_s", ".0f", short=True), shown="wide"),
    Col("ETTR", lambda s: _ratio(s.ettr)),
    Col("spares", lambda s: str(s.spares_available), shown="wide"),
    Col("stragglers", lambda s: str(len(s.stragglers)), shown="wide"),
    Col("open", lambda s: str(s.open_incidents)),
)

INCIDENTS: tuple[Col[IncidentRow], ...] = (
    Col("id", lambda i: str(i.id)),
    Col("run", lambda i: i.run),
    Col("kind", lambda i: i.kind),
    Col("node", lambda i: i.node or "-", shown="wide"),
    Col("rank", lambda i: number(i.rank), shown="wide"),
    Col("state", lambda i: i.state),
    Col("detected after s", lambda i: f"{i.detected_s - i.failed_s:.1f}", shown="wide"),
    Col("recovered after s", lambda i: _recovered_after(i), shown="wide"),
    Col("lost steps", lambda i: number(i.lost_steps), shown="wide"),
    Col("detail", lambda i: i.detail, Fit.TEXT, elsewhere=IN_FULL),
)

ACTIONS: tuple[Col[Action], ...] = (
    Col("#", lambda a: str(a.seq)),
    Col("kind", lambda a: a.kind),
    Col("state", lambda a: a.state),
    Col("started (UTC)", lambda a: when(a.created_s), shown="wide"),
    Col("took s", lambda a: "-" if a.done_s is None else f"{a.done_s - a.created_s:.1f}"),
    Col("request", lambda a: a.request_id, shown="wide"),
    Col("args → result", lambda a: _args_result(a), Fit.WORDS),
)

SPARES: tuple[Col[RunPool], ...] = (
    Col("run", lambda r: r.run),
    Col("state", lambda r: r.state, shown="wide"),
    Col("active nodes", lambda r: str(r.active_nodes), shown="wide"),
    Col("spares", lambda r: _by_health(r.spares), shown="narrow"),
    Col("spares (health)", lambda r: lines(f"{s.name} ({s.health})" for s in r.spares), shown="wide"),
    Col("usable", lambda r: str(r.available)),
    Col("recommended", lambda r: str(r.recommended)),
    Col("cordoned", lambda r: str(len(r.cordoned)), shown="narrow"),
    Col("cordoned", lambda r: lines(c.name for c in r.cordoned), shown="wide"),
    Col("why", lambda r: r.why, Fit.TEXT, shown="wide"),
)

CHECKPOINTS: tuple[Col[CheckpointEntry], ...] = (
    Col("step", lambda c: str(c.step)),
    Col("state", lambda c: c.state),
    Col("size", lambda c: size(c.bytes)),
    Col("committed (UTC)", lambda c: when(c.time_unix_s)),
    Col("blocking s", lambda c: seconds(c.blocking_s, 3), shown="wide"),
    Col("save s", lambda c: seconds(c.save_s, 2), shown="wide"),
    Col("problem", lambda c: c.problem or "", Fit.TEXT),
)


def _args_result(action: Action) -> str:
    result = action.result
    return fields(action.args) + (f"\n→ {fields(result)}" if result else "")


def _by_health(spares: Sequence[PoolNode]) -> str:
    return lines(f"{n} {health}" for health, n in Counter(s.health for s in spares).items())


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _nodes(nodes: Sequence[NodeEntry], wide: bool) -> str:
    """A run's nodes: how many of each role, or (wide) each node, its role, and why it is cordoned."""
    if wide:
        return lines(f"{n.name} ({n.role}{': ' + n.reason if n.reason else ''})" for n in nodes)
    roles = Counter(n.role or "?" for n in nodes)
    order = sorted(roles, key=lambda role: ROLES.index(role) if role in ROLES else len(ROLES))
    return ", ".join(f"{roles[role]} {role}" for role in order) or "-"


def bubble_text(pipeline: PipelineBubble, wide: bool = False) -> str:
    """A run's pipeline bubble beside the theory of its schedule (docs/pipeline.md): ``0.31 measured, theory 0.27
    (1f1b, 4 stages x 8 micro-batches), 0.04 over``; ``wide`` adds each stage's."""
    text = f"{pipeline.bubble_ratio:.2f} measured"
    theory = pipeline.theoretical_ratio
    if theory is not None:
        shape = f"{pipeline.schedule}, {pipeline.stages} stages x {pipeline.microbatches} micro-batches"
        excess = pipeline.bubble_ratio - theory
        text += f", theory {theory:.2f} ({shape}), {abs(excess):.2f} {'over' if excess > 0 else 'under'}"
        if pipeline.over_theory and pipeline.margin_ratio is not None:
            text += f" (more than the margin {pipeline.margin_ratio:.2f})"
    if wide and pipeline.stage_ratios:
        text += "; by stage " + ", ".join(f"{k}: {v:.2f}" for k, v in sorted(pipeline.stage_ratios.items()))
    return text


def _every(cadence: PlannedCadence | CadencePlan | PreviousCadence | None) -> str:
    return f"every {cadence.every_steps} steps from step {cadence.from_step}" if cadence else "-"


def _recovered_after(incident: IncidentRow) -> str:
    resumed = incident.resumed_s
    return f"{resumed - incident.detected_s:.1f}" if resumed else "-"


# -- listings ----------------------------------------------------------------------------------------------------
def runs_table(body: Sequence[RunSummary], wide: bool = False) -> Grid:
    return listing("runs", RUNS, body, wide=wide)


def statuses_table(body: Sequence[RunStatus], wide: bool = False) -> Grid:
    return listing("runs", STATUSES, body, wide=wide)


def incidents_table(body: Sequence[IncidentRow], wide: bool = False, run: str | None = None) -> Grid:
    """Every run's incidents, or those of ``run`` (then without the run column)."""
    if run is None:
        return listing("incidents", INCIDENTS, body, wide=wide)
    return listing(f"incidents of {run}", [c for c in INCIDENTS if c.header != "run"], body, wide=wide)


def spares_table(body: SparePools, wide: bool = False) -> Grid:
    pools = list(body.runs)
    shared = body.shared
    if shared is not None:
        pools.append(RunPool(**msgspec.structs.asdict(shared), run="(shared pool)", state="-"))
    return listing("spare pools", SPARES, pools, wide=wide)


def checkpoints_table(body: Checkpoints, wide: bool = False) -> Grid:
    return listing(f"checkpoints of {body.run} ({body.url or 'no store'})", CHECKPOINTS, body.checkpoints, wide=wide)


def measured(status: RunStatus, key: Literal["mfu_ratio", "tokens_per_s"], fmt: str, *, short: bool = False) -> str:
    """A job figure (``mfu_ratio``, ``tokens_per_s``) of a run's status: live while its ranks report, else the last
    one recorded, labelled so, with the run's average beside it (``short``: without)."""
    last, average = status.last_measured, status.run_average

    def shown(value: float | None) -> str:
        return "-" if value is None else format(value, fmt)

    if status.ranks or not last:
        text = shown(getattr(status, key))
    elif short:
        text = f"{shown(getattr(last, key))} (last)"
    else:
        text = f"{shown(getattr(last, key))} (last measured, launch {last.launch})"
    if average and not short:
        text += f"; run average {shown(getattr(average, key))}"
    return text


# -- one thing in full -------------------------------------------------------------------------------------------
def status_table(body: RunStatus, wide: bool = False) -> Grid:
    rows = [
        ("state", f"{body.state} (launch {body.generation})"),
        ("step", str(body.step)),
        ("ranks", str(body.ranks)),
        ("MFU", measured(body, "mfu_ratio", ".3f")),
        ("tokens/s", measured(body, "tokens_per_s", ".0f")),
        ("ETTR", _ratio(body.ettr)),
        ("checkpoint cadence", _every(body.cadence)),
        ("nodes", _nodes(body.nodes, wide)),
        ("spares available", str(body.spares_available)),
        ("stragglers", ", ".join(f"rank {s.rank} {s.slowdown_ratio:.2f}x" for s in body.stragglers) or "none"),
        ("open incidents", str(body.open_incidents)),
    ]
    hold = body.maintenance
    if hold:
        held = "every run" if hold.every_run else "this run"
        rows.append(("maintenance", f"recoveries held ({held}) since {seconds(hold.since_s, 0)}: {hold.reason}"))
    if body.agents_down:
        rows.append(
            ("agents down", ", ".join(d.node for d in body.agents_down) + " (their ranks train: nothing recovered)")
        )
    last = body.last_measured
    if body.pipeline:
        rows.append(("pipeline bubble", bubble_text(body.pipeline, wide)))
    elif last is not None and last.pipeline:  # the ranks are gone: the last recorded
        text = bubble_text(last.pipeline, wide) + f" (last measured, launch {last.pipeline_launch})"
        rows.append(("pipeline bubble", text))
    if wide:
        badput = body.badput_s
        rows += [
            ("run MTBF (s)", seconds(body.mtbf_s, 0)),
            ("badput (s)", ", ".join(f"{bucket} {s:.1f}" for bucket, s in badput.items()) or "-"),
        ]
    return pairs(f"run {body.run}", rows)


def cadence_table(body: CadenceView, wide: bool = False) -> Grid:
    cadence = body.cadence
    rows = [
        ("cadence", _every(cadence)),
        ("every (s)", seconds(cadence.every_s) if cadence else "-"),
        ("run MTBF (s)", seconds(body.mtbf_s, 0)),
        ("node MTBF (h)", f"{body.node_mtbf_h:,.0f}"),
        ("failures / node-hours", f"{body.failures} / {body.node_hours:,.2f}"),
        ("checkpoint cost (s)", seconds(body.checkpoint_cost_s, 3)),
        ("step time (s)", seconds(body.step_s, 3)),
        ("Young / Daly interval (s)", f"{seconds(body.young_interval_s)} / {seconds(body.daly_interval_s)}"),
        ("why", body.why),
    ]
    if wide:
        rows[1:1] = [("interval (s)", seconds(cadence.interval_s) if cadence else "-")]
        rows += [
            ("previous cadence", _every(body.previous)),
            ("newest step", number(body.step)),
            ("nodes", number(body.nodes)),
        ]
    return pairs(f"checkpoint cadence of {body.run}", rows)


def incident_view(incident: IncidentRow, actions: Sequence[Action], wide: bool = False) -> Group:
    """One incident, every field, and its actions with their results."""
    i = incident
    rows = [
        ("run", i.run),
        ("kind", i.kind),
        ("state", i.state),
        ("node", i.node or "-"),
        ("rank", number(i.rank)),
        ("failed (UTC)", when(i.failed_s)),
        ("detected (UTC)", f"{when(i.detected_s)} (after {i.detected_s - i.failed_s:.1f} s)"),
        ("resumed (UTC)", f"{when(i.resumed_s)} (after {_recovered_after(i)} s)" if i.resumed_s else "-"),
        ("resumed from step", number(i.resumed_from_step)),
        ("lost steps", number(i.lost_steps)),
        ("spare", i.spare or "-"),
        ("key", i.key or "-"),
        ("trace id", i.trace_id or "-"),
        ("detail", i.detail or "-"),
    ]
    shown = pairs(f"incident {i.id}", rows)
    if not actions:
        return Group(shown, Text("no actions"))
    return Group(shown, listing(f"actions of incident {i.id}", ACTIONS, actions, wide=wide))
