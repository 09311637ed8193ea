"""Reading the controller's post-mortem bundle (``GET /v1/runs/{run}/postmortem``, docs/postmortem.md): every
field checked on the way in, a bundle that does not follow the document refused with a ``PermanentError`` naming
the field."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opsd.errors import PermanentError
from opsd.postmortem.model import Checkpoint, Collective, Culprit, FlightRecorder, StuckGroup


# -- values -----------------------------------------------------------------------------------------
def bad(where: str, what: str) -> PermanentError:
    return PermanentError(f"post-mortem bundle: {where} {what}")


def read_obj(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad(where, f"must be an object, not {type(value).__name__}")
    return value


def read_list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad(where, f"must be a list, not {type(value).__name__}")
    return value


def need(obj: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in obj:
        raise bad(where, f"has no {key!r}")
    return obj[key]


def read_num(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad(where, f"must be a finite number, not {value!r}")
    return float(value)


def read_int(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(where, f"must be an integer, not {value!r}")
    return value


def read_str(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise bad(where, f"must be a string, not {value!r}")
    return value


def read_ints(value: Any, where: str) -> tuple[int, ...]:
    out = []
    for i, v in enumerate(read_list(value, where)):
        n = read_int(v, f"{where}[{i}]")
        if n is not None:
            out.append(n)
    return tuple(out)


@dataclass(frozen=True)
class ActionRow:
    incident_id: int | None
    seq: int
    kind: str
    args: dict[str, Any]
    state: str
    created_s: float | None
    done_s: float | None
    result: dict[str, Any]


def read_action(row: Any, where: str) -> ActionRow:
    a = read_obj(row, where)
    result, args = a.get("result"), a.get("args")
    return ActionRow(
        incident_id=read_int(a.get("incident_id"), f"{where}.incident_id"),
        seq=read_int(a.get("seq"), f"{where}.seq") or 0,
        kind=read_str(need(a, "kind", where), f"{where}.kind") or "?",
        args=read_obj(args, f"{where}.args") if args is not None else {},
        state=read_str(a.get("state"), f"{where}.state") or "?",
        created_s=read_num(a.get("created_s"), f"{where}.created_s"),
        done_s=read_num(a.get("done_s"), f"{where}.done_s"),
        result=read_obj(result, f"{where}.result") if result is not None else {},
    )


def read_collective(value: Any, where: str) -> Collective | None:
    if value is None:
        return None
    c = read_obj(value, where)
    pg = c.get("pg_id")
    return Collective(
        group=read_str(c.get("group"), f"{where}.group"),
        pg_id=None if pg is None else str(pg),
        seq=read_int(c.get("seq"), f"{where}.seq"),
        op=read_str(c.get("op"), f"{where}.op"),
        state=read_str(c.get("state"), f"{where}.state"),
        time_unix_s=read_num(c.get("time_unix_s"), f"{where}.time_unix_s"),
        duration_s=read_num(c.get("duration_s"), f"{where}.duration_s"),
    )


def read_analysis(trigger: str, value: Any, where: str) -> FlightRecorder:
    a = read_obj(value, where)
    culprits = []
    for i, row in enumerate(read_list(a.get("culprits"), f"{where}.culprits")):
        w = f"{where}.culprits[{i}]"
        c = read_obj(row, w)
        culprits.append(
            Culprit(
                rank=read_int(c.get("rank"), f"{w}.rank"),
                reason=read_str(c.get("reason"), f"{w}.reason") or "",
                last_collective=read_collective(c.get("last_collective"), f"{w}.last_collective"),
                stack=read_str(c.get("stack"), f"{w}.stack"),
            )
        )
    groups = []
    for i, row in enumerate(read_list(a.get("groups"), f"{where}.groups")):
        w = f"{where}.groups[{i}]"
        g = read_obj(row, w)
        pg = g.get("pg_id")
        groups.append(
            StuckGroup(
                group=read_str(g.get("group"), f"{w}.group") or "?",
                pg_id=None if pg is None else str(pg),
                ranks=read_ints(g.get("ranks"), f"{w}.ranks"),
                stuck_seq=read_int(g.get("stuck_seq"), f"{w}.stuck_seq"),
                op=read_str(g.get("op"), f"{w}.op"),
                joined=read_ints(g.get("joined"), f"{w}.joined"),
                missing=read_ints(g.get("missing"), f"{w}.missing"),
            )
        )
    return FlightRecorder(
        trigger=read_str(a.get("trigger"), f"{where}.trigger") or trigger,
        incident_id=read_int(a.get("incident_id"), f"{where}.incident_id"),
        ranks_expected=read_ints(a.get("ranks_expected"), f"{where}.ranks_expected"),
        ranks_dumped=read_ints(a.get("ranks_dumped"), f"{where}.ranks_dumped"),
        culprits=tuple(culprits),
        groups=tuple(groups),
        summary=read_str(a.get("summary"), f"{where}.summary") or "",
    )


def read_checkpoint(row: Any, where: str) -> Checkpoint:
    c = read_obj(row, where)
    step = read_int(need(c, "step", where), f"{where}.step")
    if step is None:
        raise bad(f"{where}.step", "must not be null")
    return Checkpoint(
        step=step,
        state=read_str(c.get("state"), f"{where}.state") or "unknown",
        problem=read_str(c.get("problem"), f"{where}.problem"),
        size_bytes=read_int(c.get("bytes"), f"{where}.bytes"),
        time_unix_s=read_num(c.get("time_unix_s"), f"{where}.time_unix_s"),
    )


def read_incident(raw: Any, where: str) -> dict[str, Any]:
    i = read_obj(raw, where)
    ident = read_int(need(i, "id", where), f"{where}.id")
    if ident is None:
        raise bad(f"{where}.id", "must not be null")
    return {
        "id": ident,
        "key": read_str(i.get("key"), f"{where}.key") or "",
        "kind": read_str(need(i, "kind", where), f"{where}.kind") or "unknown",
        "node": read_str(i.get("node"), f"{where}.node") or "?",
        "rank": read_int(i.get("rank"), f"{where}.rank"),
        "detail": read_str(i.get("detail"), f"{where}.detail") or "",
        "state": read_str(i.get("state"), f"{where}.state") or "unknown",
        "failed_s": read_num(i.get("failed_s"), f"{where}.failed_s"),
        "detected_s": read_num(i.get("detected_s"), f"{where}.detected_s"),
        "resumed_s": read_num(i.get("resumed_s"), f"{where}.resumed_s"),
        "resumed_from_step": read_int(i.get("resumed_from_step"), f"{where}.resumed_from_step"),
        "lost_steps": read_int(i.get("lost_steps"), f"{where}.lost_steps"),
        "spare": read_str(i.get("spare"), f"{where}.spare"),
        "trace_id": read_str(i.get("trace_id"), f"{where}.trace_id"),
        "replica_group": read_int(i.get("replica_group"), f"{where}.replica_group"),
        "missed_steps": read_int(i.get("missed_steps"), f"{where}.missed_steps"),
        "stall_s": read_num(i.get("stall_s"), f"{where}.stall_s"),
    }
