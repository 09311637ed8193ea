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

import msgspec

from opsd.errors import PermanentError
from opsd.policy.goodput import BadputBucket
from opsd.postmortem.model import (
    BADPUT_BUCKETS,
    KIND_WORDS,
    PHASE_NAMES,
    XID_ACTION_WORDS,
    ExitFacts,
    Goodput,
    IncidentReport,
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
from opsd.protocol.answers import CheckpointEntry, LastMeasured, Mtbf, RunAverage, RunStatus
from opsd.protocol.bundle import Blocking, Bundle, LaunchRecord, XidMeaning, read_bundle
from opsd.protocol.flight_analysis import FlightAnalysis
from opsd.protocol.records import Action, IncidentRow
from opsd.protocol.states import WARNING_KINDS, ActionKind, ActionState, IncidentKind, IncidentState, NodeRole
from opsd.protocol.steps import (
    Blame,
    CheckpointTaken,
    Cordoned,
    CordonStep,
    Dumped,
    Launched,
    SpareTaken,
    Step,
    Stopped,
    StopStep,
    result_record,
)

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


def _root_cause(row: IncidentRow, xid_table: Mapping[str, XidMeaning], analysis: FlightAnalysis | None) -> RootCause:
    kind, node, rank, detail = row.kind, row.node, row.rank, row.detail
    words = KIND_WORDS.get(kind, kind.replace("_", " "))
    where = f"{node}" + (f" (rank {rank})" if rank is not None else "")
    match = _XID.match(detail)
    if kind in (IncidentKind.FATAL_XID, IncidentKind.APPLICATION_XID) and match:
        code, gpu = int(match.group(1)), int(match.group(2))
        entry = xid_table.get(str(code)) or XidMeaning()
        meaning, action = entry.meaning or match.group(3) or "not in the XID table", entry.action
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


def _step(a: Action) -> Step | None:
    """The step an action records (None: its args make none, as a newer controller's might)."""
    try:
        return a.step
    except PermanentError:
        return None


def _action_detail(a: Action) -> str:
    r, step = a.outcome, _step(a)
    if a.kind == ActionKind.STOP:
        text = f"stopped generation {step.generation if isinstance(step, StopStep) else '?'}"
        text += f": {r.killed} processes killed" if isinstance(r, Stopped) else ""
    elif a.kind == ActionKind.CORDON:
        node = r.node if isinstance(r, Cordoned) and r.node else step.node if isinstance(step, CordonStep) else "?"
        text = f"cordoned {node}"
    elif a.kind == ActionKind.TAKE_SPARE:
        if isinstance(r, SpareTaken) and r.spare:
            text = f"took spare {r.spare}"
        elif isinstance(r, SpareTaken) and r.shrunk_to_nodes is not None:
            text = f"no spare: went on with {r.shrunk_to_nodes} nodes"
        else:
            text = "waiting for a spare"
    elif a.kind == ActionKind.LAUNCH:
        launched = r if isinstance(r, Launched) else Launched()
        on = ", ".join(launched.nodes) if launched.nodes is not None else "?"
        text = f"generation {'?' if launched.generation is None else launched.generation} on {on}"
        if launched.resumed_from_step is not None:
            text += f", from the checkpoint of step {launched.resumed_from_step}"
    elif a.kind == ActionKind.DUMP:
        text = "Flight Recorder dump asked of every rank"
        if isinstance(r, Dumped) and (culprit := r.culprit) is not None:
            first = culprit.first_blamed or Blame()
            text += f"; it names rank {culprit.rank} on {culprit.node}"
            if (first.rank, first.node) != (culprit.rank, culprit.node):
                text += f" (first blamed: rank {first.rank} on {first.node})"
        if isinstance(r, Dumped) and r.quarantine is not None:
            text += f"; {r.quarantine.node} is swapped: {r.quarantine.reason}"
    elif isinstance(r, CheckpointTaken):  # field by field as the controller wrote it
        text = "; ".join(f"{k}={v}" for k, v in result_record(r).items())
    else:
        text = a.kind
    return text if a.state == ActionState.DONE else f"{text} (not done)"


def _timeline(row: IncidentRow, actions: Sequence[Action]) -> tuple[Phase, ...]:
    t0 = row.failed_s

    def rel(t: float | None) -> float | None:
        return None if t is None or t0 is None else t - t0

    detected = row.detected_s
    phases = [
        Phase("failure", rel(t0), rel(t0), row.detail),
        Phase("detection", rel(t0), rel(detected), f"{row.kind} detected on {row.node}"),
    ]
    previous = detected
    for a in sorted(actions, key=lambda a: a.seq):
        start = a.created_s if previous is None else max(previous, a.created_s or previous)
        end = a.done_s if a.state == ActionState.DONE else None
        phases.append(Phase(PHASE_NAMES.get(a.kind, a.kind), rel(start), rel(end), _action_detail(a)))
        previous = end if end is not None else previous
    resumed = row.resumed_s
    if resumed is not None or row.state == IncidentState.OPEN:
        step = row.resumed_from_step
        after = f" after restoring step {step}" if step is not None else ""
        detail = "first productive step" + after if resumed is not None else "no productive step yet"
        phases.append(Phase("first step", rel(previous), rel(resumed), detail))
    return tuple(phases)


def _resume(row: IncidentRow, actions: Sequence[Action], checkpoints: Sequence[CheckpointEntry]) -> Resume:
    launches = [a for a in actions if a.kind == ActionKind.LAUNCH and a.state == ActionState.DONE]
    done = launches[-1].outcome if launches else None
    result = done if isinstance(done, Launched) else Launched()
    step = result.resumed_from_step if result.resumed_from_step is not None else row.resumed_from_step
    if step is None:
        return Resume(None, "not relaunched" + (" yet" if row.state == IncidentState.OPEN else ""), ())
    if row.replica_group is not None:  # a replica recovery: the group healed from a live one, no checkpoint read
        return Resume(step, f"step {step}: healed from a live replica group, no checkpoint read", ())
    states = {c.step: c for c in checkpoints}
    skipped: list[SkippedCheckpoint] = []
    if result.skipped is not None:
        for gone in result.skipped:
            known = states.get(gone.step)
            problem = gone.problem or (known.problem if known else None) or "unusable"
            skipped.append(SkippedCheckpoint(gone.step, known.state if known else "unusable", problem))
    elif row.lost_steps is not None:
        newest = step + row.lost_steps
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


def build(raw: Bundle | Any, incident_id: int | None = None) -> Report:
    """The post-mortem of one incident, or of the whole run when ``incident_id`` is None, from the bundle (as the
    controller built it, or as decoded JSON). Raises PermanentError naming the field's path when the bundle does not
    follow docs/postmortem.md, or when the run has no such incident."""
    bundle = raw if isinstance(raw, Bundle) else read_bundle(raw)
    now_s, run, status = bundle.generated_unix_s, bundle.run, bundle.status or RunStatus()
    rows, actions = bundle.incidents or (), bundle.actions or ()
    checkpoints = sorted(bundle.checkpoints or (), key=lambda c: c.step)
    # an analysis names its trigger; one that does not (an older bundle's) is named by its key
    analyses = [
        a if a.trigger else msgspec.structs.replace(a, trigger=trigger)
        for trigger, a in (bundle.flight_recorder or {}).items()
    ]
    if incident_id is not None and (isinstance(incident_id, bool) or not isinstance(incident_id, int)):
        raise PermanentError(f"incident id must be an integer, not {incident_id!r}")
    if incident_id is not None and incident_id not in {r.id for r in rows}:
        known = ", ".join(str(r.id) for r in rows) or "none"
        raise PermanentError(f"run {run.id!r} has no incident {incident_id} (its incidents: {known})")

    mtbf = bundle.mtbf or Mtbf(mtbf_s=status.mtbf_s)  # older bundles: the status's MTBF alone
    goodput = _goodput(status, bundle.checkpoint_blocking_s or Blocking(), mtbf)
    collectives = _collectives(bundle.launches or ())
    recompute_total = dict(goodput.badput_s).get(BadputBucket.RECOMPUTE)
    lost_total = sum(r.lost_steps or 0 for r in rows if r.kind not in WARNING_KINDS)

    def analysis_of(ident: int) -> FlightAnalysis | None:
        for a in analyses:
            if a.incident_id == ident or a.trigger == f"incident-{ident}":
                return a
        return None

    reports = []
    for r in rows:
        if incident_id is not None and r.id != incident_id:
            continue
        mine = [a for a in actions if a.incident_id == r.id]
        failed, detected, resumed = r.failed_s, r.detected_s, r.resumed_s
        end = resumed if resumed is not None else now_s if r.state == IncidentState.OPEN else None
        recompute = None
        if recompute_total is not None and r.lost_steps is not None and r.kind not in WARNING_KINDS:
            recompute = recompute_total * r.lost_steps / lost_total if lost_total else 0.0
        reports.append(
            IncidentReport(
                id=r.id,
                key=r.key,
                kind=r.kind,
                node=r.node,
                rank=r.rank,
                state=r.state,
                detail=r.detail,
                failed_unix_s=failed,
                detected_unix_s=detected,
                resumed_unix_s=resumed,
                detection_delay_s=None if failed is None or detected is None else detected - failed,
                downtime_s=None if failed is None or end is None else end - failed,
                lost_steps=r.lost_steps,
                recompute_s=recompute,
                spare=r.spare,
                root_cause=_root_cause(r, bundle.xid_table or {}, analysis_of(r.id)),
                timeline=_timeline(r, mine) if r.kind not in WARNING_KINDS else (),
                resume=_resume(r, mine, checkpoints),
                launch=(launch := _launch_of(r.key)),
                collectives=collectives.get(launch, ()) if launch is not None else (),
                trace_id=r.trace_id,
                replica_group=r.replica_group,
                missed_steps=r.missed_steps,
                stall_s=r.stall_s,
            )
        )
    reported = {i.id for i in reports}
    dumps = tuple(
        a
        for a in analyses
        if incident_id is None and not any(a.incident_id == n or a.trigger == f"incident-{n}" for n in reported)
    )
    stragglers = tuple(_straggler(r) for r in rows if r.kind == IncidentKind.STRAGGLER)
    cordoned = tuple((n.name, n.reason) for n in status.nodes if n.role == NodeRole.CORDONED)
    return Report(
        run_id=run.id,
        run_state=run.state,
        generated_unix_s=now_s,
        created_unix_s=run.created_s,
        updated_unix_s=run.updated_s,
        generation=run.generation,
        last_step=run.last_step,
        final_step=run.final_step,
        incident_id=incident_id,
        incidents=tuple(reports),
        totals=_totals(reports) if incident_id is None else None,
        goodput=goodput,
        stragglers=stragglers,
        checkpoints=tuple(checkpoints),
        cordoned=cordoned,
        dumps=dumps,
    )


def _straggler(r: IncidentRow) -> StragglerWarning:
    match = _STRAGGLER.search(r.detail)
    rank = r.rank if r.rank is not None else int(match.group(1)) if match else None
    try:
        ratio = float(match.group(3).rstrip(".")) if match else None
    except ValueError:
        ratio = None
    time_s = r.detected_s if r.detected_s is not None else r.failed_s
    return StragglerWarning(r.id, time_s, rank, r.node, ratio, r.detail)


_LAUNCH = re.compile(r"/gen(\d+)$")


def _launch_of(key: str) -> int | None:
    """The launch an incident happened in, from its key (``<run>/gen<N>``)."""
    match = _LAUNCH.search(key)
    return int(match.group(1)) if match else None


def _collectives(launches: Sequence[LaunchRecord]) -> dict[int, tuple[tuple[str, float], ...]]:
    """Each launch's longest collective stacks, from the bundle's ``launches`` (absent from older bundles)."""
    out: dict[int, tuple[tuple[str, float], ...]] = {}
    for row in launches:
        stacks = [(k, v) for k, v in (row.comm or {}).items() if v is not None]
        if row.generation is not None:
            out[row.generation] = tuple(sorted(stacks, key=lambda kv: -kv[1]))
    return out


def _goodput(status: RunStatus, blocking: Blocking, mtbf: Mtbf) -> Goodput:
    badput = dict(status.badput_s)
    order = [b for b in BADPUT_BUCKETS if b in badput] + sorted(k for k in badput if k not in BADPUT_BUCKETS)
    last, average = status.last_measured or LastMeasured(), status.run_average or RunAverage()
    return Goodput(
        ettr=status.ettr,
        badput_s=tuple((k, badput[k]) for k in order),
        mtbf=mtbf,
        mfu_ratio=status.mfu_ratio,
        tokens_per_s=status.tokens_per_s,
        checkpoint_saves=blocking.count,
        checkpoint_blocking_mean_s=blocking.mean_s,
        checkpoint_blocking_max_s=blocking.max_s,
        mfu_last=last.mfu_ratio,
        tokens_per_s_last=last.tokens_per_s,
        last_launch=last.launch,
        mfu_average=average.mfu_ratio,
        tokens_per_s_average=average.tokens_per_s,
        pipeline=_pipeline(status, last, average),
    )


def _pipeline(status: RunStatus, last: LastMeasured, average: RunAverage) -> PipelineBubble | None:
    """The run's pipeline bubble: live while its ranks report, else the last one recorded; None for no pipeline."""
    p = status.pipeline or last.pipeline
    if p is None:
        return None
    return PipelineBubble(
        bubble_ratio=p.bubble_ratio,
        theoretical_ratio=p.theoretical_ratio,
        schedule=p.schedule,
        stages=p.stages,
        micro_batches=p.microbatches,
        launch=None if status.pipeline else last.pipeline_launch,
        average_ratio=average.bubble_ratio,
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
