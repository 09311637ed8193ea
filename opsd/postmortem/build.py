"""The post-mortem of a run, or of one of its incidents, from the controller's bundle (docs/postmortem.md).

``build`` reads the bundle (``GET /v1/runs/{run}/postmortem``) into a ``Report``: pure, no I/O and no clock (the
bundle's ``generated_unix_s`` is "now"). ``to_markdown`` and ``to_html`` render it (``opsd.postmortem.render``);
the HTML is one self-contained file with the plots of ``opsd.postmortem.plots`` inlined as PNG data URLs. Every
string taken from the bundle is escaped on the way out.

How the figures are made:

- The timeline of a recovery: the incident's ``failed_s``, ``detected_s`` and ``resumed_s`` (the first productive
  step of the relaunch) and its actions in order. An action starts when it was recorded or when the previous one
  was done, whichever is later (a recovery records its actions when it starts; they are carried out one by one).
- Recomputed seconds of an incident: the run's ``recompute`` badput shared out in proportion to lost steps (the
  controller counts each lost step at the run's median step time).
- The checkpoint resumed from and why: the launch action's ``resumed_from_step`` and ``skipped``; without
  ``skipped``, the checkpoints newer than it that were not committed and existed at the failure (steps up to
  ``resumed_from_step + lost_steps``).
"""

from __future__ import annotations

import re
import signal
from collections.abc import Mapping, Sequence
from typing import Any

from opsd.errors import PermanentError
from opsd.policy.goodput import BadputBucket
from opsd.postmortem.model import (
    BADPUT_BUCKETS,
    KIND_WORDS,
    PHASE_NAMES,
    XID_ACTION_WORDS,
    Checkpoint,
    ExitFacts,
    FlightRecorder,
    Goodput,
    IncidentReport,
    Mtbf,
    Phase,
    PipelineBubble,
    Report,
    Resume,
    RootCause,
    SkippedCheckpoint,
    StragglerWarning,
    Totals,
    XidFacts,
)
from opsd.postmortem.read import (
    ActionRow,
    bad,
    need,
    read_action,
    read_analysis,
    read_checkpoint,
    read_incident,
    read_int,
    read_list,
    read_num,
    read_obj,
    read_str,
)
from opsd.protocol.states import ActionKind, ActionState, IncidentKind, IncidentState, NodeRole

_XID = re.compile(r"^XID (\d+) on GPU (\d+):\s*(.*)$", re.S)
_EXIT = re.compile(r"exited with (-?\d+)")
_STRAGGLER = re.compile(r"rank (\d+) on (\S+) ([0-9.]+)x")


# -- deciding what it says --------------------------------------------------------------------------------------
def signal_name(exit_code: int) -> str | None:
    """The signal that ended a process: a negative exit code (Python's ``returncode``), or 128 + n (a shell's)."""
    number = -exit_code if exit_code < 0 else exit_code - 128 if 128 < exit_code < 128 + 65 else None
    if number is None:
        return None
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _root_cause(row: Mapping[str, Any], xid_table: Mapping[str, Any], analysis: FlightRecorder | None) -> RootCause:
    kind, node, rank, detail = row["kind"], row["node"], row["rank"], row["detail"]
    words = KIND_WORDS.get(kind, kind.replace("_", " "))
    where = f"{node}" + (f" (rank {rank})" if rank is not None else "")
    match = _XID.match(detail)
    if kind in (IncidentKind.FATAL_XID, IncidentKind.APPLICATION_XID) and match:
        code, gpu = int(match.group(1)), int(match.group(2))
        entry = xid_table.get(str(code))
        entry = entry if isinstance(entry, dict) else {}
        meaning = str(entry.get("meaning") or match.group(3) or "not in the XID table")
        action = None if entry.get("action") is None else str(entry["action"])
        todo = f"; action: {action} ({XID_ACTION_WORDS.get(action, action)})" if action else ""
        summary = f"XID {code} ({meaning}) on GPU {gpu} of {node}{todo}"
        return RootCause(kind, words, node, rank, summary, xid=XidFacts(code, gpu, node, meaning, action))
    exited = _EXIT.search(detail)
    if kind == IncidentKind.PROCESS_EXIT:
        exit_code = int(exited.group(1)) if exited else None
        name = signal_name(exit_code) if exit_code is not None else None
        how = f"exited with {exit_code}" if exit_code is not None else "exited"
        how += f" ({name})" if name else ""
        summary = f"rank {rank if rank is not None else '?'} on {node} {how}"
        return RootCause(kind, words, node, rank, summary, exit=ExitFacts(rank, exit_code, name))
    if analysis is not None and (analysis.summary or analysis.culprits):
        named = ", ".join(f"rank {c.rank}" for c in analysis.culprits) or "none named"
        summary = analysis.summary or f"Flight Recorder culprits: {named}"
        return RootCause(kind, words, node, rank, summary, flight_recorder=analysis)
    if kind == IncidentKind.HANG:
        summary = f"no step progress; suspect {where} (furthest behind), no Flight Recorder analysis: {detail}"
    else:
        summary = f"{words} on {where}: {detail}"
    return RootCause(kind, words, node, rank, summary, flight_recorder=analysis)


def _action_detail(a: ActionRow) -> str:
    r, args = a.result, a.args
    if a.kind == ActionKind.STOP:
        text = f"stopped generation {args.get('generation', '?')}"
        text += f": {r['killed']} processes killed" if "killed" in r else ""
    elif a.kind == ActionKind.CORDON:
        text = f"cordoned {r.get('node') or args.get('node') or '?'}"
    elif a.kind == ActionKind.TAKE_SPARE:
        if r.get("spare"):
            text = f"took spare {r['spare']}"
        elif "shrunk_to_nodes" in r:
            text = f"no spare: went on with {r['shrunk_to_nodes']} nodes"
        else:
            text = "waiting for a spare"
    elif a.kind == ActionKind.LAUNCH:
        nodes = r.get("nodes")
        on = ", ".join(str(n) for n in nodes) if isinstance(nodes, list) else "?"
        text = f"generation {r.get('generation', '?')} on {on}"
        if r.get("resumed_from_step") is not None:
            text += f", from the checkpoint of step {r['resumed_from_step']}"
    elif a.kind == ActionKind.DUMP:
        text = "Flight Recorder dump asked of every rank"
        culprit = r.get("culprit") if isinstance(r.get("culprit"), dict) else None
        if culprit is not None:
            first = culprit.get("first_blamed") if isinstance(culprit.get("first_blamed"), dict) else {}
            text += f"; it names rank {culprit.get('rank')} on {culprit.get('node')}"
            if (first.get("rank"), first.get("node")) != (culprit.get("rank"), culprit.get("node")):
                text += f" (first blamed: rank {first.get('rank')} on {first.get('node')})"
        if isinstance(r.get("quarantine"), dict):
            text += f"; {r['quarantine'].get('node')} is swapped: {r['quarantine'].get('reason')}"
    else:
        text = "; ".join(f"{k}={v}" for k, v in r.items()) or a.kind
    return text if a.state == ActionState.DONE else f"{text} (not done)"


def _timeline(row: Mapping[str, Any], actions: Sequence[ActionRow]) -> tuple[Phase, ...]:
    t0 = row["failed_s"]

    def rel(t: float | None) -> float | None:
        return None if t is None or t0 is None else t - t0

    detected = row["detected_s"]
    phases = [
        Phase("failure", rel(t0), rel(t0), row["detail"]),
        Phase("detection", rel(t0), rel(detected), f"{row['kind']} detected on {row['node']}"),
    ]
    previous = detected
    for a in sorted(actions, key=lambda a: a.seq):
        start = a.created_s if previous is None else max(previous, a.created_s or previous)
        end = a.done_s if a.state == ActionState.DONE else None
        phases.append(Phase(PHASE_NAMES.get(a.kind, a.kind), rel(start), rel(end), _action_detail(a)))
        previous = end if end is not None else previous
    resumed = row["resumed_s"]
    if resumed is not None or row["state"] == IncidentState.OPEN:
        step = row["resumed_from_step"]
        after = f" after restoring step {step}" if step is not None else ""
        detail = "first productive step" + after if resumed is not None else "no productive step yet"
        phases.append(Phase("first step", rel(previous), rel(resumed), detail))
    return tuple(phases)


def _resume(row: Mapping[str, Any], actions: Sequence[ActionRow], checkpoints: Sequence[Checkpoint]) -> Resume:
    launches = [a for a in actions if a.kind == ActionKind.LAUNCH and a.state == ActionState.DONE]
    result = launches[-1].result if launches else {}
    step = read_int(result.get("resumed_from_step"), "actions[launch].result.resumed_from_step")
    if step is None:
        step = row["resumed_from_step"]
    if step is None:
        return Resume(None, "not relaunched" + (" yet" if row["state"] == IncidentState.OPEN else ""), ())
    if row["replica_group"] is not None:  # a replica recovery: the group healed from a live one, no checkpoint read
        return Resume(step, f"step {step}: healed from a live replica group, no checkpoint read", ())
    states = {c.step: c for c in checkpoints}
    skipped: list[SkippedCheckpoint] = []
    if isinstance(result.get("skipped"), list):
        for i, s in enumerate(result["skipped"]):
            s = read_obj(s, f"actions[launch].result.skipped[{i}]")
            n = read_int(s.get("step"), f"actions[launch].result.skipped[{i}].step")
            if n is None:
                continue
            known = states.get(n)
            problem = read_str(s.get("problem"), "skipped.problem") or (known.problem if known else None) or "unusable"
            skipped.append(SkippedCheckpoint(n, known.state if known else "unusable", problem))
    elif row["lost_steps"] is not None:
        newest = step + int(row["lost_steps"])
        for c in checkpoints:
            if step < c.step <= newest and c.state != "committed":
                skipped.append(SkippedCheckpoint(c.step, c.state, c.problem or "not committed"))
    skipped.sort(key=lambda s: -s.step)
    head = f"step {step}" if step > 0 else "from the start"
    if not skipped:
        why = "the newest committed checkpoint" if step > 0 else "no committed checkpoint before the failure"
    elif len(skipped) == 1:
        s = skipped[0]
        why = f"the newest, step {s.step}, was {s.state}: {s.problem}"
    else:
        why = f"the {len(skipped)} newer ones were not usable: " + "; ".join(
            f"step {s.step} was {s.state}: {s.problem}" for s in skipped
        )
    return Resume(step, f"{head}: {why}", tuple(skipped))


def build(bundle: dict[str, Any], incident_id: int | None = None) -> Report:
    """The post-mortem of one incident, or of the whole run when ``incident_id`` is None. Raises PermanentError
    naming the field when the bundle does not follow docs/postmortem.md, or when the run has no such incident."""
    bundle = read_obj(bundle, "the bundle")
    for key in ("generated_unix_s", "run", "status", "incidents", "actions", "checkpoints"):
        need(bundle, key, "the bundle")
    now_s = read_num(bundle["generated_unix_s"], "generated_unix_s")
    if now_s is None:
        raise bad("generated_unix_s", "must not be null")
    run = read_obj(bundle["run"], "run")
    run_id = read_str(need(run, "id", "run"), "run.id")
    if not run_id:
        raise bad("run.id", "must be a non-empty string")
    status = read_obj(bundle["status"], "status") if bundle["status"] is not None else {}
    rows = [read_incident(r, f"incidents[{n}]") for n, r in enumerate(read_list(bundle["incidents"], "incidents"))]
    actions = [read_action(a, f"actions[{n}]") for n, a in enumerate(read_list(bundle["actions"], "actions"))]
    rows_of_checkpoints = enumerate(read_list(bundle["checkpoints"], "checkpoints"))
    checkpoints = sorted(
        (read_checkpoint(c, f"checkpoints[{n}]") for n, c in rows_of_checkpoints), key=lambda c: c.step
    )
    fr = bundle.get("flight_recorder") or {}
    analyses = [read_analysis(str(t), a, f"flight_recorder[{t!r}]") for t, a in read_obj(fr, "flight_recorder").items()]
    xid_table = read_obj(bundle.get("xid_table") or {}, "xid_table")
    if incident_id is not None and (isinstance(incident_id, bool) or not isinstance(incident_id, int)):
        raise PermanentError(f"incident id must be an integer, not {incident_id!r}")
    if incident_id is not None and incident_id not in {r["id"] for r in rows}:
        known = ", ".join(str(r["id"]) for r in rows) or "none"
        raise PermanentError(f"run {run_id!r} has no incident {incident_id} (its incidents: {known})")

    goodput = _goodput(status, bundle.get("checkpoint_blocking_s"), bundle.get("mtbf"))
    collectives = _collectives(bundle.get("launches"))
    recompute_total = dict(goodput.badput_s).get(BadputBucket.RECOMPUTE)
    lost_total = sum(r["lost_steps"] or 0 for r in rows if r["kind"] != IncidentKind.STRAGGLER)

    def analysis_of(ident: int) -> FlightRecorder | None:
        for a in analyses:
            if a.incident_id == ident or a.trigger == f"incident-{ident}":
                return a
        return None

    reports = []
    for r in rows:
        if incident_id is not None and r["id"] != incident_id:
            continue
        mine = [a for a in actions if a.incident_id == r["id"]]
        failed, detected, resumed = r["failed_s"], r["detected_s"], r["resumed_s"]
        end = resumed if resumed is not None else now_s if r["state"] == IncidentState.OPEN else None
        recompute = None
        if recompute_total is not None and r["lost_steps"] is not None and r["kind"] != IncidentKind.STRAGGLER:
            recompute = recompute_total * r["lost_steps"] / lost_total if lost_total else 0.0
        reports.append(
            IncidentReport(
                id=r["id"],
                key=r["key"],
                kind=r["kind"],
                node=r["node"],
                rank=r["rank"],
                state=r["state"],
                detail=r["detail"],
                failed_unix_s=failed,
                detected_unix_s=detected,
                resumed_unix_s=resumed,
                detection_delay_s=None if failed is None or detected is None else detected - failed,
                downtime_s=None if failed is None or end is None else end - failed,
                lost_steps=r["lost_steps"],
                recompute_s=recompute,
                spare=r["spare"],
                root_cause=_root_cause(r, xid_table, analysis_of(r["id"])),
                timeline=_timeline(r, mine) if r["kind"] != IncidentKind.STRAGGLER else (),
                resume=_resume(r, mine, checkpoints),
                launch=(launch := _launch_of(r["key"])),
                collectives=collectives.get(launch, ()) if launch is not None else (),
                trace_id=r["trace_id"],
                replica_group=r["replica_group"],
                missed_steps=r["missed_steps"],
                stall_s=r["stall_s"],
            )
        )
    reported = {i.id for i in reports}
    dumps = tuple(
        a
        for a in analyses
        if incident_id is None and not any(a.incident_id == n or a.trigger == f"incident-{n}" for n in reported)
    )
    stragglers = tuple(_straggler(r) for r in rows if r["kind"] == IncidentKind.STRAGGLER)
    nodes = read_list(status.get("nodes"), "status.nodes")
    cordoned = []
    for n, node in enumerate(nodes):
        node = read_obj(node, f"status.nodes[{n}]")
        if node.get("role") == NodeRole.CORDONED:
            cordoned.append((str(node.get("name") or "?"), str(node.get("reason") or "")))
    return Report(
        run_id=run_id,
        run_state=read_str(run.get("state"), "run.state"),
        generated_unix_s=now_s,
        created_unix_s=read_num(run.get("created_s"), "run.created_s"),
        updated_unix_s=read_num(run.get("updated_s"), "run.updated_s"),
        generation=read_int(run.get("generation"), "run.generation"),
        last_step=read_int(run.get("last_step"), "run.last_step"),
        final_step=read_int(run.get("final_step"), "run.final_step"),
        incident_id=incident_id,
        incidents=tuple(reports),
        totals=_totals(reports) if incident_id is None else None,
        goodput=goodput,
        stragglers=stragglers,
        checkpoints=tuple(checkpoints),
        cordoned=tuple(cordoned),
        dumps=dumps,
    )


def _straggler(r: Mapping[str, Any]) -> StragglerWarning:
    match = _STRAGGLER.search(r["detail"])
    rank = r["rank"] if r["rank"] is not None else int(match.group(1)) if match else None
    try:
        ratio = float(match.group(3).rstrip(".")) if match else None
    except ValueError:
        ratio = None
    time_s = r["detected_s"] if r["detected_s"] is not None else r["failed_s"]
    return StragglerWarning(r["id"], time_s, rank, r["node"], ratio, r["detail"])


_LAUNCH = re.compile(r"/gen(\d+)$")


def _launch_of(key: str) -> int | None:
    """The launch an incident happened in, from its key (``<run>/gen<N>``)."""
    match = _LAUNCH.search(key)
    return int(match.group(1)) if match else None


def _collectives(raw: Any) -> dict[int, tuple[tuple[str, float], ...]]:
    """Each launch's longest collective stacks, from the bundle's ``launches`` (absent from older bundles)."""
    out: dict[int, tuple[tuple[str, float], ...]] = {}
    for n, row in enumerate(read_list(raw or [], "launches")):
        row = read_obj(row, f"launches[{n}]")
        generation = read_int(need(row, "generation", f"launches[{n}]"), f"launches[{n}].generation")
        comm = read_obj(row.get("comm") or {}, f"launches[{n}].comm")
        stacks = [(str(k), read_num(v, f"launches[{n}].comm[{k!r}]")) for k, v in comm.items()]
        if generation is not None:
            out[generation] = tuple(sorted(((k, v) for k, v in stacks if v is not None), key=lambda kv: -kv[1]))
    return out


def _mtbf(raw: Any, status: Mapping[str, Any]) -> Mtbf:
    """The MTBF and its inputs (the bundle's ``mtbf``; older bundles: the status's ``mtbf_s`` alone)."""
    m = read_obj(raw or {}, "mtbf")
    prior = read_obj(m.get("prior") or {}, "mtbf.prior")
    return Mtbf(
        mtbf_s=read_num(m.get("mtbf_s", status.get("mtbf_s")), "mtbf.mtbf_s"),
        node_mtbf_h=read_num(m.get("node_mtbf_h"), "mtbf.node_mtbf_h"),
        failures=read_int(m.get("failures"), "mtbf.failures"),
        node_hours=read_num(m.get("node_hours"), "mtbf.node_hours"),
        nodes=read_int(m.get("nodes"), "mtbf.nodes"),
        prior_node_mtbf_h=read_num(prior.get("node_mtbf_h"), "mtbf.prior.node_mtbf_h"),
        prior_node_hours=read_num(prior.get("node_hours"), "mtbf.prior.node_hours"),
    )


def _goodput(status: Mapping[str, Any], blocking: Any, mtbf: Any) -> Goodput:
    raw = read_obj(status.get("badput_s") or {}, "status.badput_s")
    badput = {str(k): read_num(v, f"status.badput_s.{k}") for k, v in raw.items()}
    for k, v in badput.items():
        if v is not None and v < 0:
            raise bad(f"status.badput_s.{k}", f"must be >= 0, not {v!r}")
    order = [b for b in BADPUT_BUCKETS if b in badput] + sorted(k for k in badput if k not in BADPUT_BUCKETS)
    b = read_obj(blocking, "checkpoint_blocking_s") if blocking is not None else {}
    last = read_obj(status.get("last_measured") or {}, "status.last_measured")
    average = read_obj(status.get("run_average") or {}, "status.run_average")
    return Goodput(
        ettr=read_num(status.get("ettr"), "status.ettr"),
        badput_s=tuple((k, v) for k in order if (v := badput[k]) is not None),
        mtbf=_mtbf(mtbf, status),
        mfu_ratio=read_num(status.get("mfu_ratio"), "status.mfu_ratio"),
        tokens_per_s=read_num(status.get("tokens_per_s"), "status.tokens_per_s"),
        checkpoint_saves=read_int(b.get("count"), "checkpoint_blocking_s.count"),
        checkpoint_blocking_mean_s=read_num(b.get("mean_s"), "checkpoint_blocking_s.mean_s"),
        checkpoint_blocking_max_s=read_num(b.get("max_s"), "checkpoint_blocking_s.max_s"),
        mfu_last=read_num(last.get("mfu_ratio"), "status.last_measured.mfu_ratio"),
        tokens_per_s_last=read_num(last.get("tokens_per_s"), "status.last_measured.tokens_per_s"),
        last_launch=read_int(last.get("launch"), "status.last_measured.launch"),
        mfu_average=read_num(average.get("mfu_ratio"), "status.run_average.mfu_ratio"),
        tokens_per_s_average=read_num(average.get("tokens_per_s"), "status.run_average.tokens_per_s"),
        pipeline=_pipeline(status, last, average),
    )


def _pipeline(status: Mapping[str, Any], last: Mapping[str, Any], average: Mapping[str, Any]) -> PipelineBubble | None:
    """The run's pipeline bubble: live while its ranks report, else the last one recorded; None for no pipeline."""
    live = status.get("pipeline")
    where = "status.pipeline" if live else "status.last_measured.pipeline"
    raw = read_obj(live, where) if live else read_obj(last.get("pipeline") or {}, where)
    if not raw:
        return None
    measured = read_num(raw.get("bubble_ratio"), f"{where}.bubble_ratio")
    if measured is None:
        raise bad(where, "has no bubble_ratio")
    return PipelineBubble(
        bubble_ratio=measured,
        theoretical_ratio=read_num(raw.get("theoretical_ratio"), f"{where}.theoretical_ratio"),
        schedule=read_str(raw.get("schedule"), f"{where}.schedule") or "",
        stages=read_int(raw.get("stages"), f"{where}.stages"),
        micro_batches=read_int(raw.get("microbatches"), f"{where}.microbatches"),
        launch=None if live else read_int(last.get("pipeline_launch"), "status.last_measured.pipeline_launch"),
        average_ratio=read_num(average.get("bubble_ratio"), "status.run_average.bubble_ratio"),
    )


def _totals(reports: Sequence[IncidentReport]) -> Totals:
    failures = [i for i in reports if i.is_failure]
    kinds: dict[str, int] = {}
    for i in failures:
        kinds[i.kind] = kinds.get(i.kind, 0) + 1
    recompute = [i.recompute_s for i in failures if i.recompute_s is not None]
    return Totals(
        interruptions=len(failures),
        straggler_warnings=len(reports) - len(failures),
        by_kind=tuple(sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0]))),
        downtime_s=sum(i.downtime_s or 0.0 for i in failures),
        detection_s=sum(i.detection_delay_s or 0.0 for i in failures),
        lost_steps=sum(i.lost_steps or 0 for i in failures),
        recompute_s=sum(recompute) if recompute else None,
    )
