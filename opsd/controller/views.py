"""What the API answers besides the store's rows: the spare pools, a run's checkpoints, its cadence and why, and
the post-mortem bundle (docs/postmortem.md). Read-only; the decisions stay in ``opsd.policy``."""

from __future__ import annotations

import itertools
import logging
import math
import statistics

import msgspec

from opsd.checkpoints.layout import inspect_checkpoints
from opsd.checkpoints.store import open_store
from opsd.controller.controller import Controller
from opsd.controller.flight import analyses
from opsd.controller.incidents import NOT_FAILURES
from opsd.controller.port import SharedSpares
from opsd.controller.rows import RunRow
from opsd.errors import NotFoundError, OpsError
from opsd.policy.cadence import daly_interval_s, node_failure_rate_per_h, run_mtbf_s, young_interval_s
from opsd.policy.spares import spare_pool_size
from opsd.protocol.answers import (
    CadencePlan,
    CadenceView,
    CheckpointEntry,
    Checkpoints,
    Cordoned,
    PoolNode,
    PreviousCadence,
    Prior,
    RunPool,
    SharedPool,
    SparePools,
)
from opsd.protocol.bundle import Blocking, Bundle, LaunchRecord, RunSummary, XidMeaning
from opsd.protocol.manifest import ManifestError, parse_manifest
from opsd.protocol.records import IncidentRow, NodeRow
from opsd.protocol.states import NodeRole, RunState
from opsd.protocol.xid_table import xid_meanings

log = logging.getLogger(__name__)

# a spare's health: usable ones are chosen for a swap
HEALTHY, UNKNOWN, FAULTY, UNREACHABLE = "healthy", "unknown", "faulty", "unreachable"
USABLE = (HEALTHY, UNKNOWN)


def node_health(controller: Controller, node: str, now_s: float) -> tuple[str, str]:
    """(health, why) of a node from its agent's heartbeats: GPU events that call for an action make it faulty, a
    silence longer than the heartbeat floor unreachable, no heartbeat yet unknown."""
    with controller.lock:
        live = controller.nodes.get(node)
        if live is None:
            return UNKNOWN, "no heartbeat yet"
        silent_s = now_s - live.last_heartbeat_s
        pending = [f"XID {e.xid} on GPU {e.gpu} ({e.action})" for e in live.events.values()]
    if pending:
        return FAULTY, "; ".join(pending)
    floor_s = controller.config.detection.heartbeat_floor_s
    if silent_s > floor_s:
        return UNREACHABLE, f"no heartbeat for {silent_s:.0f} s"
    return HEALTHY, f"heartbeat {silent_s:.1f} s ago"


def node_mtbf_h(
    controller: Controller,
    run: RunRow,
    nodes: int,
    now_s: float,
    incidents: list[IncidentRow] | None = None,
) -> tuple[float, int, float]:
    """(node MTBF in hours, failures, node-hours) of ``run``: the cadence's posterior (prior + the run's failures);
    ``incidents``: the run's, when the caller has them already. A finished run's node-hours end with it."""
    if incidents is None:
        incidents = controller.store.incidents(run.id)
    failures = sum(1 for i in incidents if i.kind not in NOT_FAILURES)
    end_s = float(run.updated_s) if RunState(run.state).finished else now_s
    node_hours = max(1, nodes) * max(0.0, end_s - float(run.created_s)) / 3600.0
    rate = node_failure_rate_per_h(failures, node_hours, controller.config.cadence)
    return 1.0 / rate, failures, node_hours


def recommended_spares(
    controller: Controller,
    run: RunRow,
    active_nodes: int,
    now_s: float,
    incidents: list[IncidentRow] | None = None,
) -> tuple[int, str]:
    """The spare pool size for ``run`` (``opsd.policy.spares``) and why, in one line."""
    config = controller.config
    mtbf_h, failures, node_hours = node_mtbf_h(controller, run, active_nodes, now_s, incidents)
    size = spare_pool_size(active_nodes, config.spare_window_h, mtbf_h, config.spare_risk)
    why = (
        f"P(more than {size} of {active_nodes} nodes fail within {config.spare_window_h:g} h)"
        f" <= {config.spare_risk:g} at a node MTBF of {mtbf_h:,.0f} h"
        f" ({failures} failures in {node_hours:,.1f} node-hours, with the prior)"
    )
    return size, why


def pool_entry(controller: Controller, node: NodeRow, now_s: float) -> PoolNode:
    health, why = node_health(controller, node.name, now_s)
    return PoolNode(name=node.name, domain=node.domain, health=health, why=why)


def shared_pool(controller: Controller, now_s: float) -> SharedPool | None:
    """The cluster's spare pool (spares of no run: those of a backend whose spares are shared, as Kubernetes'
    ``opsd.io/pool=spare``) with each node's health, and its recommended size: the binomial rule over every active
    node of the runs still going, at the node MTBF of their failures and node-hours together. None when the backend's
    spares are its runs' own and none is free."""
    runs = controller.store.runs()
    nodes = controller.store.nodes()
    spares = [n for n in nodes if n.role == NodeRole.SPARE and n.run is None]
    if not spares and not isinstance(controller.backend, SharedSpares):
        return None
    going = [r for r in runs if not RunState(r.state).finished]
    active = sum(1 for n in nodes if n.role == NodeRole.ACTIVE and n.run in {r.id for r in going})
    failures, node_hours = 0, 0.0
    for run in going:
        run_active = sum(1 for n in nodes if n.role == NodeRole.ACTIVE and n.run == run.id)
        _, run_failures, run_hours = node_mtbf_h(controller, run, run_active, now_s)
        failures, node_hours = failures + run_failures, node_hours + run_hours
    config = controller.config
    mtbf_h = 1.0 / node_failure_rate_per_h(failures, node_hours, config.cadence)
    size = spare_pool_size(active, config.spare_window_h, mtbf_h, config.spare_risk)
    pool = tuple(pool_entry(controller, n, now_s) for n in spares)
    return SharedPool(
        active_nodes=active,
        spares=pool,
        available=sum(1 for s in pool if s.health in USABLE),
        recommended=size,
        why=(
            f"P(more than {size} of {active} nodes of {len(going)} runs fail within {config.spare_window_h:g} h)"
            f" <= {config.spare_risk:g} at a node MTBF of {mtbf_h:,.0f} h"
            f" ({failures} failures in {node_hours:,.1f} node-hours, with the prior)"
        ),
    )


def spares_view(controller: Controller, now_s: float) -> SparePools:
    """Per run: its own spare pool with each node's health, and the recommended pool size with the reason; and the
    cluster's shared pool, when runs draw from one (``shared``: None otherwise)."""
    out = []
    for run in controller.store.runs():
        nodes = controller.store.nodes(run.id)
        active = [n for n in nodes if n.role == NodeRole.ACTIVE]
        pool = tuple(pool_entry(controller, n, now_s) for n in nodes if n.role == NodeRole.SPARE)
        recommended, why = recommended_spares(controller, run, len(active), now_s)
        out.append(
            RunPool(
                run=run.id,
                state=run.state,
                active_nodes=len(active),
                spares=pool,
                available=sum(1 for s in pool if s.health in USABLE),
                recommended=recommended,
                why=why,
                cordoned=tuple(Cordoned(name=n.name, reason=n.reason) for n in nodes if n.role == NodeRole.CORDONED),
            )
        )
    return SparePools(runs=tuple(out), shared=shared_pool(controller, now_s))


def checkpoints_view(controller: Controller, run_id: str) -> Checkpoints:
    """The run's checkpoints, newest first: committed or torn (and why), bytes, commit time, blocking seconds."""
    run = controller.store.run(run_id)
    if run is None:
        raise NotFoundError(f"no run {run_id!r}")
    url = run.spec.checkpoint_url
    if not url:
        return Checkpoints(run=run_id, why="the run has no checkpoint store")
    store = open_store(url)
    rows = []
    for c in inspect_checkpoints(store):
        row = CheckpointEntry(
            step=c.step, state="committed" if c.problem is None else "torn", problem=c.problem, bytes=c.total_bytes
        )
        if c.problem is None:
            try:
                data = store.read_manifest(c.step)
                manifest = parse_manifest(data) if data is not None else None
            except (OSError, OpsError, ManifestError) as exc:
                log.warning("run %s: manifest of step %d unreadable: %s", run_id, c.step, exc)
                manifest = None
            if manifest is not None:
                row = msgspec.structs.replace(
                    row, time_unix_s=manifest.time_unix_s, blocking_s=manifest.blocking_s, save_s=manifest.save_s
                )
        rows.append(row)
    return Checkpoints(run=run_id, url=url, checkpoints=tuple(rows))


def cadence_view(controller: Controller, run_id: str, now_s: float) -> CadenceView:
    """The checkpoint cadence of a run and its inputs: MTBF estimate, checkpoint cost, step time, the interval by
    Young's and Daly's rules, and the cadence published (or why there is none yet)."""
    run = controller.store.run(run_id)
    if run is None:
        raise NotFoundError(f"no run {run_id!r}")
    with controller.lock:
        live = controller.live_of(run_id)
        memory = controller.memory.get(run_id)
        cadence = memory.cadence if memory is not None else None
        previous = memory.previous_cadence if memory is not None else None
        step_s = statistics.median(live.step_times_s) if live is not None and live.step_times_s else None
        saves = live.checkpoints if live is not None else 0
        cost_s = live.checkpoint_blocking_s / saves if live is not None and saves else None
        nodes = len(live.rank_nodes) if live is not None else 0
        newest = live.newest_step if live is not None else None
    if nodes == 0:  # no rank heard from (a finished run, a controller just started): the nodes the run holds
        nodes = len(controller.store.node_names(run_id, NodeRole.ACTIVE))
    mtbf_h, failures, node_hours = node_mtbf_h(controller, run, nodes, now_s)
    config = controller.config.cadence
    mtbf_s = run_mtbf_s(failures, node_hours, nodes, controller.config.cadence) if nodes else None
    young_s = daly_s = None
    if mtbf_s is not None and cost_s is not None:
        young_s, daly_s = young_interval_s(cost_s, mtbf_s), daly_interval_s(cost_s, mtbf_s)
    if cadence is None:
        missing = [name for name, v in (("step times", step_s), ("a checkpoint's cost", cost_s)) if v is None]
        why = "not planned yet: no " + " and no ".join(missing) if missing else "not planned yet"
    else:
        why = cadence.reason
    return CadenceView(
        run=run_id,
        step=newest,
        nodes=nodes,
        prior=Prior(node_mtbf_h=config.prior_mtbf_node_h, node_hours=config.prior_node_hours),
        failures=failures,
        node_hours=node_hours,
        node_mtbf_h=mtbf_h,
        mtbf_s=mtbf_s,
        checkpoint_cost_s=cost_s,
        step_s=step_s,
        young_interval_s=young_s,
        daly_interval_s=daly_s,
        cadence=None
        if cadence is None
        else CadencePlan(
            every_steps=cadence.every_steps,
            from_step=cadence.from_step,
            interval_s=cadence.interval_s,
            every_s=cadence.every_steps * step_s if step_s else None,
            mtbf_s=cadence.mtbf_s,
        ),
        previous=None
        if cadence is None or previous is None
        else PreviousCadence(every_steps=previous.every_steps, from_step=previous.from_step),
        why=why,
    )


def cadence_interval_s(controller: Controller, run_id: str) -> float | None:
    """The published cadence in seconds (its steps times the median step time), for the checkpoint-age alert."""
    with controller.lock:
        memory = controller.memory.get(run_id)
        cadence = memory.cadence if memory is not None else None
        live = controller.live_of(run_id)
        if cadence is None:
            return None
        if live is not None and live.step_times_s:
            return cadence.every_steps * statistics.median(live.step_times_s)
        return cadence.interval_s


def postmortem_bundle(controller: Controller, run_id: str, now_s: float) -> Bundle:
    """Everything a post-mortem of ``run_id`` is made of (docs/postmortem.md); rendered by ``opsd.postmortem``."""
    run = controller.store.run(run_id)
    status = controller.status(run_id, now_s)
    if run is None or status is None:
        raise NotFoundError(f"no run {run_id!r}")
    incidents = controller.store.incidents(run_id)
    try:
        checkpoints = checkpoints_view(controller, run_id).checkpoints
    except OpsError as exc:
        log.warning("run %s: checkpoints unavailable for the post-mortem: %s", run_id, exc)
        checkpoints = ()
    blocking = [c.blocking_s for c in checkpoints if c.blocking_s is not None]
    per_launch = launch_stacks(controller, run_id)
    codes = {int(word) for i in incidents for word in _xid_codes(i.detail)}
    table = xid_meanings()
    return Bundle(
        generated_unix_s=now_s,
        run=RunSummary(
            id=run.id,
            state=run.state,
            created_s=run.created_s,
            updated_s=run.updated_s,
            generation=run.generation,
            last_step=run.last_step,
            final_step=run.final_step,
        ),
        status=status,
        incidents=tuple(incidents),
        actions=tuple(controller.store.actions(run=run_id)),
        checkpoints=checkpoints,
        checkpoint_blocking_s=Blocking(
            count=len(blocking),
            mean_s=math.fsum(blocking) / len(blocking) if blocking else None,
            max_s=max(blocking, default=None),
        ),
        flight_recorder=analyses(controller, run_id),
        xid_table={str(code): XidMeaning(**table[code]) for code in sorted(codes) if code in table},
        mtbf=cadence_view(controller, run_id, now_s).mtbf(),
        launches=tuple(
            LaunchRecord(
                generation=row.generation,
                started_s=row.started_s,
                updated_s=row.updated_s,
                first_step=row.first_step,
                last_step=row.last_step,
                ranks=row.ranks,
                samples=row.samples,
                comm=dict(top_stacks(per_launch.get(row.generation, {}))),
            )
            for row in controller.store.launches(run_id)
        ),
    )


TOP_STACKS = 12  # the post-mortem's collective stacks of a launch, the longest first


def top_stacks(stacks: dict[tuple[str, ...], float]) -> list[tuple[str, float]]:
    """The ``TOP_STACKS`` longest stacks as ``("phase;dimension;op", seconds)``."""
    ordered = sorted(stacks.items(), key=lambda kv: (-kv[1], kv[0]))[:TOP_STACKS]
    return [(";".join(stack), seconds) for stack, seconds in ordered]


def _xid_codes(detail: str) -> list[str]:
    """The codes of ``XID <n>`` mentions in an incident's detail."""
    words = detail.replace(":", " ").split()
    return [b for a, b in itertools.pairwise(words) if a == "XID" and b.isdigit()]


def launch_stacks(controller: Controller, run_id: str) -> dict[int, dict[tuple[str, ...], float]]:
    """Each launch's collective seconds by (phase, dimension, op): as recorded, and for the launch under way the
    larger of the recorded and what its agents report now."""
    run = controller.store.run(run_id)
    if run is None:
        raise NotFoundError(f"no run {run_id!r}")
    out = {
        int(row.generation): {tuple(k.split(";")): v for k, v in row.comm.items()}
        for row in controller.store.launches(run_id)
    }
    live = controller.launch_comm_seconds(run_id)
    if live:
        current = out.setdefault(int(run.generation), {})
        for stack, seconds in live.items():
            current[stack] = max(seconds, current.get(stack, 0.0))
    return out


def flame_stacks(controller: Controller, run_id: str, launch: int | None) -> dict[tuple[str, ...], float]:
    """The run's collective seconds by stack: of one launch, or summed over every launch (None)."""
    per_launch = launch_stacks(controller, run_id)
    if launch is not None:
        return per_launch.get(launch, {})
    total: dict[tuple[str, ...], float] = {}
    for stacks in per_launch.values():
        for stack, seconds in stacks.items():
            total[stack] = total.get(stack, 0.0) + seconds
    return total
