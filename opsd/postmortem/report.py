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

import math
import re
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from opsd.errors import PermanentError

KIND_WORDS = {
    "heartbeat_loss": "node lost (no heartbeats)",
    "fatal_xid": "fatal GPU error (XID)",
    "application_xid": "application GPU error (XID)",
    "process_exit": "rank process exited",
    "hang": "hang (no step progress)",
    "collective_timeout": "collective timeout",
    "straggler": "straggler warning",
    "controller_restart": "controller restart",
    "manual_restart": "manual restart",
}
XID_ACTION_WORDS = {
    "cordon_and_swap": "a hardware fault: cordon the node and swap in a spare",
    "restart_job": "an application error: restart the job on the same nodes",
    "watch_window": "benign alone: escalated to a swap when it repeats",
}
PHASE_NAMES = {"dump": "dump", "stop": "stop", "cordon": "cordon", "take_spare": "swap", "launch": "relaunch"}
BADPUT_BUCKETS = ("checkpoint", "detection", "spare_wait", "restart", "recompute")
_XID = re.compile(r"^XID (\d+) on GPU (\d+):\s*(.*)$", re.S)
_EXIT = re.compile(r"exited with (-?\d+)")
_STRAGGLER = re.compile(r"rank (\d+) on (\S+) ([0-9.]+)x")


# -- the report -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Phase:
    """One phase of a recovery, in seconds after the failure (``end_s`` None: not over)."""

    name: str  # failure | detection | dump | stop | cordon | swap | relaunch | first step | another action's kind
    start_s: float | None
    end_s: float | None
    detail: str

    @property
    def duration_s(self) -> float | None:
        return None if self.start_s is None or self.end_s is None else max(0.0, self.end_s - self.start_s)


@dataclass(frozen=True)
class XidFacts:
    code: int
    gpu: int
    node: str
    meaning: str
    action: str | None  # cordon_and_swap | restart_job | watch_window, from the bundle's xid_table


@dataclass(frozen=True)
class ExitFacts:
    rank: int | None
    exit_code: int | None
    signal_name: str | None  # -9 (or 137 = 128 + 9, as shells report it): SIGKILL


@dataclass(frozen=True)
class Collective:
    group: str | None
    pg_id: str | None
    seq: int | None
    op: str | None
    state: str | None
    time_unix_s: float | None

    def describe(self) -> str:
        where = f"{self.op or 'collective'} #{self.seq if self.seq is not None else '?'} on {self.group or '?'}"
        where += f" (pg {self.pg_id})" if self.pg_id is not None else ""
        when = f" at {clock(self.time_unix_s)}" if self.time_unix_s is not None else ""
        return f"{where}, {self.state or 'state unknown'}{when}"


@dataclass(frozen=True)
class Culprit:
    rank: int | None
    reason: str
    last_collective: Collective | None
    stack: str | None


@dataclass(frozen=True)
class StuckGroup:
    group: str
    pg_id: str | None
    ranks: tuple[int, ...]
    stuck_seq: int | None
    op: str | None
    joined: tuple[int, ...]
    missing: tuple[int, ...]


@dataclass(frozen=True)
class FlightRecorder:
    """The analysis of one Flight Recorder dump (docs/postmortem.md)."""

    trigger: str
    incident_id: int | None
    ranks_expected: tuple[int, ...]
    ranks_dumped: tuple[int, ...]
    culprits: tuple[Culprit, ...]
    groups: tuple[StuckGroup, ...]
    summary: str


@dataclass(frozen=True)
class RootCause:
    kind: str
    words: str  # the kind in words
    node: str
    rank: int | None
    summary: str  # one sentence
    xid: XidFacts | None = None
    exit: ExitFacts | None = None
    flight_recorder: FlightRecorder | None = None


@dataclass(frozen=True)
class SkippedCheckpoint:
    step: int
    state: str
    problem: str


@dataclass(frozen=True)
class Resume:
    step: int | None  # None: not relaunched (yet)
    reason: str  # "step 30: the newest, step 40, was torn: no manifest"
    skipped: tuple[SkippedCheckpoint, ...]


@dataclass(frozen=True)
class IncidentReport:
    id: int
    key: str
    kind: str
    node: str
    rank: int | None
    state: str
    detail: str
    failed_unix_s: float | None
    detected_unix_s: float | None
    resumed_unix_s: float | None
    detection_delay_s: float | None
    downtime_s: float | None  # failure -> first productive step (-> the bundle's time while still open)
    lost_steps: int | None
    recompute_s: float | None
    spare: str | None
    root_cause: RootCause
    timeline: tuple[Phase, ...]
    resume: Resume

    @property
    def is_failure(self) -> bool:
        return self.kind != "straggler"


@dataclass(frozen=True)
class StragglerWarning:
    incident_id: int
    time_unix_s: float | None
    rank: int | None
    node: str
    slowdown_ratio: float | None
    detail: str


@dataclass(frozen=True)
class Checkpoint:
    step: int
    state: str  # committed | torn
    problem: str | None
    size_bytes: int | None
    time_unix_s: float | None


@dataclass(frozen=True)
class Goodput:
    ettr: float | None
    badput_s: tuple[tuple[str, float], ...]  # (bucket, seconds), in BADPUT_BUCKETS' order, then any other
    mtbf_s: float | None
    mfu_ratio: float | None
    tokens_per_s: float | None
    checkpoint_saves: int | None
    checkpoint_blocking_mean_s: float | None
    checkpoint_blocking_max_s: float | None


@dataclass(frozen=True)
class Totals:
    interruptions: int
    straggler_warnings: int
    by_kind: tuple[tuple[str, int], ...]
    downtime_s: float
    detection_s: float
    lost_steps: int
    recompute_s: float | None


@dataclass(frozen=True)
class Report:
    run_id: str
    run_state: str | None
    generated_unix_s: float
    created_unix_s: float | None
    updated_unix_s: float | None
    generation: int | None
    last_step: int | None
    final_step: int | None
    incident_id: int | None  # the incident reported on; None: the whole run
    incidents: tuple[IncidentReport, ...]  # that one, or every incident of the run (straggler warnings included)
    totals: Totals | None  # the whole run only
    goodput: Goodput
    stragglers: tuple[StragglerWarning, ...]
    checkpoints: tuple[Checkpoint, ...]  # oldest first
    cordoned: tuple[tuple[str, str], ...]  # (node, why)
    dumps: tuple[FlightRecorder, ...]  # Flight Recorder analyses not tied to an incident reported on

    @property
    def detailed(self) -> tuple[IncidentReport, ...]:
        """The incidents that get a section of their own: the one asked for, or every interruption."""
        if self.incident_id is not None:
            return self.incidents
        return tuple(i for i in self.incidents if i.is_failure)


# -- reading the bundle -----------------------------------------------------------------------------------------
def _bad(where: str, what: str) -> PermanentError:
    return PermanentError(f"post-mortem bundle: {where} {what}")


def _obj(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad(where, f"must be an object, not {type(value).__name__}")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _bad(where, f"must be a list, not {type(value).__name__}")
    return value


def _need(obj: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in obj:
        raise _bad(where, f"has no {key!r}")
    return obj[key]


def _num(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(where, f"must be a finite number, not {value!r}")
    return float(value)


def _int(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(where, f"must be an integer, not {value!r}")
    return value


def _str(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise _bad(where, f"must be a string, not {value!r}")
    return value


def _ints(value: Any, where: str) -> tuple[int, ...]:
    out = []
    for i, v in enumerate(_list(value, where)):
        n = _int(v, f"{where}[{i}]")
        if n is not None:
            out.append(n)
    return tuple(out)


@dataclass(frozen=True)
class _Action:
    incident_id: int | None
    seq: int
    kind: str
    args: dict[str, Any]
    state: str
    created_s: float | None
    done_s: float | None
    result: dict[str, Any]


def _read_action(row: Any, where: str) -> _Action:
    a = _obj(row, where)
    result, args = a.get("result"), a.get("args")
    return _Action(
        incident_id=_int(a.get("incident_id"), f"{where}.incident_id"),
        seq=_int(a.get("seq"), f"{where}.seq") or 0,
        kind=_str(_need(a, "kind", where), f"{where}.kind") or "?",
        args=_obj(args, f"{where}.args") if args is not None else {},
        state=_str(a.get("state"), f"{where}.state") or "?",
        created_s=_num(a.get("created_s"), f"{where}.created_s"),
        done_s=_num(a.get("done_s"), f"{where}.done_s"),
        result=_obj(result, f"{where}.result") if result is not None else {},
    )


def _read_collective(value: Any, where: str) -> Collective | None:
    if value is None:
        return None
    c = _obj(value, where)
    pg = c.get("pg_id")
    return Collective(
        group=_str(c.get("group"), f"{where}.group"),
        pg_id=None if pg is None else str(pg),
        seq=_int(c.get("seq"), f"{where}.seq"),
        op=_str(c.get("op"), f"{where}.op"),
        state=_str(c.get("state"), f"{where}.state"),
        time_unix_s=_num(c.get("time_unix_s"), f"{where}.time_unix_s"),
    )


def _read_analysis(trigger: str, value: Any, where: str) -> FlightRecorder:
    a = _obj(value, where)
    culprits = []
    for i, row in enumerate(_list(a.get("culprits"), f"{where}.culprits")):
        w = f"{where}.culprits[{i}]"
        c = _obj(row, w)
        culprits.append(
            Culprit(
                rank=_int(c.get("rank"), f"{w}.rank"),
                reason=_str(c.get("reason"), f"{w}.reason") or "",
                last_collective=_read_collective(c.get("last_collective"), f"{w}.last_collective"),
                stack=_str(c.get("stack"), f"{w}.stack"),
            )
        )
    groups = []
    for i, row in enumerate(_list(a.get("groups"), f"{where}.groups")):
        w = f"{where}.groups[{i}]"
        g = _obj(row, w)
        pg = g.get("pg_id")
        groups.append(
            StuckGroup(
                group=_str(g.get("group"), f"{w}.group") or "?",
                pg_id=None if pg is None else str(pg),
                ranks=_ints(g.get("ranks"), f"{w}.ranks"),
                stuck_seq=_int(g.get("stuck_seq"), f"{w}.stuck_seq"),
                op=_str(g.get("op"), f"{w}.op"),
                joined=_ints(g.get("joined"), f"{w}.joined"),
                missing=_ints(g.get("missing"), f"{w}.missing"),
            )
        )
    return FlightRecorder(
        trigger=_str(a.get("trigger"), f"{where}.trigger") or trigger,
        incident_id=_int(a.get("incident_id"), f"{where}.incident_id"),
        ranks_expected=_ints(a.get("ranks_expected"), f"{where}.ranks_expected"),
        ranks_dumped=_ints(a.get("ranks_dumped"), f"{where}.ranks_dumped"),
        culprits=tuple(culprits),
        groups=tuple(groups),
        summary=_str(a.get("summary"), f"{where}.summary") or "",
    )


def _read_checkpoint(row: Any, where: str) -> Checkpoint:
    c = _obj(row, where)
    step = _int(_need(c, "step", where), f"{where}.step")
    if step is None:
        raise _bad(f"{where}.step", "must not be null")
    return Checkpoint(
        step=step,
        state=_str(c.get("state"), f"{where}.state") or "unknown",
        problem=_str(c.get("problem"), f"{where}.problem"),
        size_bytes=_int(c.get("bytes"), f"{where}.bytes"),
        time_unix_s=_num(c.get("time_unix_s"), f"{where}.time_unix_s"),
    )


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
    if kind in ("fatal_xid", "application_xid") and match:
        code, gpu = int(match.group(1)), int(match.group(2))
        entry = xid_table.get(str(code))
        entry = entry if isinstance(entry, dict) else {}
        meaning = str(entry.get("meaning") or match.group(3) or "not in the XID table")
        action = None if entry.get("action") is None else str(entry["action"])
        todo = f"; action: {action} ({XID_ACTION_WORDS.get(action, action)})" if action else ""
        summary = f"XID {code} ({meaning}) on GPU {gpu} of {node}{todo}"
        return RootCause(kind, words, node, rank, summary, xid=XidFacts(code, gpu, node, meaning, action))
    exited = _EXIT.search(detail)
    if kind == "process_exit":
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
    if kind == "hang":
        summary = f"no step progress; suspect {where} (furthest behind), no Flight Recorder analysis: {detail}"
    else:
        summary = f"{words} on {where}: {detail}"
    return RootCause(kind, words, node, rank, summary, flight_recorder=analysis)


def _action_detail(a: _Action) -> str:
    r, args = a.result, a.args
    if a.kind == "stop":
        text = f"stopped generation {args.get('generation', '?')}"
        text += f": {r['killed']} processes killed" if "killed" in r else ""
    elif a.kind == "cordon":
        text = f"cordoned {r.get('node') or args.get('node') or '?'}"
    elif a.kind == "take_spare":
        if r.get("spare"):
            text = f"took spare {r['spare']}"
        elif "shrunk_to_nodes" in r:
            text = f"no spare: went on with {r['shrunk_to_nodes']} nodes"
        else:
            text = "waiting for a spare"
    elif a.kind == "launch":
        nodes = r.get("nodes")
        on = ", ".join(str(n) for n in nodes) if isinstance(nodes, list) else "?"
        text = f"generation {r.get('generation', '?')} on {on}"
        if r.get("resumed_from_step") is not None:
            text += f", from the checkpoint of step {r['resumed_from_step']}"
    elif a.kind == "dump":
        text = "Flight Recorder dump asked of every rank"
    else:
        text = "; ".join(f"{k}={v}" for k, v in r.items()) or a.kind
    return text if a.state == "done" else f"{text} (not done)"


def _timeline(row: Mapping[str, Any], actions: Sequence[_Action]) -> tuple[Phase, ...]:
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
        end = a.done_s if a.state == "done" else None
        phases.append(Phase(PHASE_NAMES.get(a.kind, a.kind), rel(start), rel(end), _action_detail(a)))
        previous = end if end is not None else previous
    resumed = row["resumed_s"]
    if resumed is not None or row["state"] == "open":
        step = row["resumed_from_step"]
        after = f" after restoring step {step}" if step is not None else ""
        detail = "first productive step" + after if resumed is not None else "no productive step yet"
        phases.append(Phase("first step", rel(previous), rel(resumed), detail))
    return tuple(phases)


def _resume(row: Mapping[str, Any], actions: Sequence[_Action], checkpoints: Sequence[Checkpoint]) -> Resume:
    launches = [a for a in actions if a.kind == "launch" and a.state == "done"]
    result = launches[-1].result if launches else {}
    step = _int(result.get("resumed_from_step"), "actions[launch].result.resumed_from_step")
    if step is None:
        step = row["resumed_from_step"]
    if step is None:
        return Resume(None, "not relaunched" + (" yet" if row["state"] == "open" else ""), ())
    states = {c.step: c for c in checkpoints}
    skipped: list[SkippedCheckpoint] = []
    if isinstance(result.get("skipped"), list):
        for i, s in enumerate(result["skipped"]):
            s = _obj(s, f"actions[launch].result.skipped[{i}]")
            n = _int(s.get("step"), f"actions[launch].result.skipped[{i}].step")
            if n is None:
                continue
            known = states.get(n)
            problem = _str(s.get("problem"), "skipped.problem") or (known.problem if known else None) or "unusable"
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


def _read_incident(raw: Any, where: str) -> dict[str, Any]:
    i = _obj(raw, where)
    ident = _int(_need(i, "id", where), f"{where}.id")
    if ident is None:
        raise _bad(f"{where}.id", "must not be null")
    return {
        "id": ident,
        "key": _str(i.get("key"), f"{where}.key") or "",
        "kind": _str(_need(i, "kind", where), f"{where}.kind") or "unknown",
        "node": _str(i.get("node"), f"{where}.node") or "?",
        "rank": _int(i.get("rank"), f"{where}.rank"),
        "detail": _str(i.get("detail"), f"{where}.detail") or "",
        "state": _str(i.get("state"), f"{where}.state") or "unknown",
        "failed_s": _num(i.get("failed_s"), f"{where}.failed_s"),
        "detected_s": _num(i.get("detected_s"), f"{where}.detected_s"),
        "resumed_s": _num(i.get("resumed_s"), f"{where}.resumed_s"),
        "resumed_from_step": _int(i.get("resumed_from_step"), f"{where}.resumed_from_step"),
        "lost_steps": _int(i.get("lost_steps"), f"{where}.lost_steps"),
        "spare": _str(i.get("spare"), f"{where}.spare"),
    }


def build(bundle: dict[str, Any], incident_id: int | None = None) -> Report:
    """The post-mortem of one incident, or of the whole run when ``incident_id`` is None. Raises PermanentError
    naming the field when the bundle does not follow docs/postmortem.md, or when the run has no such incident."""
    bundle = _obj(bundle, "the bundle")
    for key in ("generated_unix_s", "run", "status", "incidents", "actions", "checkpoints"):
        _need(bundle, key, "the bundle")
    now_s = _num(bundle["generated_unix_s"], "generated_unix_s")
    if now_s is None:
        raise _bad("generated_unix_s", "must not be null")
    run = _obj(bundle["run"], "run")
    run_id = _str(_need(run, "id", "run"), "run.id")
    if not run_id:
        raise _bad("run.id", "must be a non-empty string")
    status = _obj(bundle["status"], "status") if bundle["status"] is not None else {}
    rows = [_read_incident(r, f"incidents[{n}]") for n, r in enumerate(_list(bundle["incidents"], "incidents"))]
    actions = [_read_action(a, f"actions[{n}]") for n, a in enumerate(_list(bundle["actions"], "actions"))]
    checkpoints = sorted(
        (_read_checkpoint(c, f"checkpoints[{n}]") for n, c in enumerate(_list(bundle["checkpoints"], "checkpoints"))),
        key=lambda c: c.step,
    )
    fr = bundle.get("flight_recorder") or {}
    analyses = [_read_analysis(str(t), a, f"flight_recorder[{t!r}]") for t, a in _obj(fr, "flight_recorder").items()]
    xid_table = _obj(bundle.get("xid_table") or {}, "xid_table")
    if incident_id is not None and (isinstance(incident_id, bool) or not isinstance(incident_id, int)):
        raise PermanentError(f"incident id must be an integer, not {incident_id!r}")
    if incident_id is not None and incident_id not in {r["id"] for r in rows}:
        known = ", ".join(str(r["id"]) for r in rows) or "none"
        raise PermanentError(f"run {run_id!r} has no incident {incident_id} (its incidents: {known})")

    goodput = _goodput(status, bundle.get("checkpoint_blocking_s"))
    recompute_total = dict(goodput.badput_s).get("recompute")
    lost_total = sum(r["lost_steps"] or 0 for r in rows if r["kind"] != "straggler")

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
        end = resumed if resumed is not None else now_s if r["state"] == "open" else None
        recompute = None
        if recompute_total is not None and r["lost_steps"] is not None and r["kind"] != "straggler":
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
                timeline=_timeline(r, mine) if r["kind"] != "straggler" else (),
                resume=_resume(r, mine, checkpoints),
            )
        )
    reported = {i.id for i in reports}
    dumps = tuple(
        a
        for a in analyses
        if incident_id is None and not any(a.incident_id == n or a.trigger == f"incident-{n}" for n in reported)
    )
    stragglers = tuple(_straggler(r) for r in rows if r["kind"] == "straggler")
    nodes = _list(status.get("nodes"), "status.nodes")
    cordoned = []
    for n, node in enumerate(nodes):
        node = _obj(node, f"status.nodes[{n}]")
        if node.get("role") == "cordoned":
            cordoned.append((str(node.get("name") or "?"), str(node.get("reason") or "")))
    return Report(
        run_id=run_id,
        run_state=_str(run.get("state"), "run.state"),
        generated_unix_s=now_s,
        created_unix_s=_num(run.get("created_s"), "run.created_s"),
        updated_unix_s=_num(run.get("updated_s"), "run.updated_s"),
        generation=_int(run.get("generation"), "run.generation"),
        last_step=_int(run.get("last_step"), "run.last_step"),
        final_step=_int(run.get("final_step"), "run.final_step"),
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


def _goodput(status: Mapping[str, Any], blocking: Any) -> Goodput:
    raw = _obj(status.get("badput_s") or {}, "status.badput_s")
    badput = {str(k): _num(v, f"status.badput_s.{k}") for k, v in raw.items()}
    for k, v in badput.items():
        if v is not None and v < 0:
            raise _bad(f"status.badput_s.{k}", f"must be >= 0, not {v!r}")
    order = [b for b in BADPUT_BUCKETS if b in badput] + sorted(k for k in badput if k not in BADPUT_BUCKETS)
    b = _obj(blocking, "checkpoint_blocking_s") if blocking is not None else {}
    return Goodput(
        ettr=_num(status.get("ettr"), "status.ettr"),
        badput_s=tuple((k, v) for k in order if (v := badput[k]) is not None),
        mtbf_s=_num(status.get("mtbf_s"), "status.mtbf_s"),
        mfu_ratio=_num(status.get("mfu_ratio"), "status.mfu_ratio"),
        tokens_per_s=_num(status.get("tokens_per_s"), "status.tokens_per_s"),
        checkpoint_saves=_int(b.get("count"), "checkpoint_blocking_s.count"),
        checkpoint_blocking_mean_s=_num(b.get("mean_s"), "checkpoint_blocking_s.mean_s"),
        checkpoint_blocking_max_s=_num(b.get("max_s"), "checkpoint_blocking_s.max_s"),
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


# -- words ------------------------------------------------------------------------------------------------------
def clock(time_unix_s: float | None) -> str:
    """A Unix time as ``2026-11-21 10:06:40.0 UTC`` (or "?")."""
    if time_unix_s is None:
        return "?"
    try:
        moment = datetime.fromtimestamp(time_unix_s, UTC)
    except (OverflowError, OSError, ValueError):
        return f"{time_unix_s:g} (not a date)"
    return moment.strftime("%Y-%m-%d %H:%M:%S.") + f"{moment.microsecond // 100_000} UTC"


def seconds(value: float | None) -> str:
    """A duration for people: ``1.2 s``, ``3 min 20 s``, ``2 h 05 min``."""
    if value is None:
        return "?"
    if not math.isfinite(value):
        return f"{value} s"
    sign, value = ("-" if value < 0 else ""), abs(value)
    if value < 1:
        return f"{sign}{value:.2f} s"
    if value < 60:
        return f"{sign}{value:.1f} s"
    if value < 3600:
        return f"{sign}{int(value // 60)} min {int(value % 60):02d} s"
    return f"{sign}{int(value // 3600)} h {int(value % 3600 // 60):02d} min"


def to_markdown(report: Report) -> str:
    """The report as GitHub-flavoured Markdown (the plots are in the HTML only)."""
    from opsd.postmortem.render import render_markdown

    return render_markdown(report)


def to_html(report: Report) -> str:
    """The report as one self-contained HTML page: inline CSS, the plots as PNG data URLs, no script, nothing
    fetched."""
    from opsd.postmortem.render import render_html

    return render_html(report)
