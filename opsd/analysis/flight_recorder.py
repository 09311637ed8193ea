"""Who hung the run: the Flight Recorder dumps of its ranks, matched per process group by sequence id.

Pure: dumps in (``trainer_hooks.flight`` writes them; docs/flight-recorder.md), one analysis out; no I/O, no clock.

The method is that of PyTorch's Flight Recorder analyzer (``torch/distributed/flight_recorder``, ``fr_trace``):
every collective of a process group has a sequence id, the same on every member, counted from 1. A rank's dump
gives, per group, the last sequence id it issued (enqueued) and the last that completed (``pg_status``; on gloo,
whose entries stay ``scheduled``, that is the only completion there is). Then, per group:

- the collective stuck is the highest sequence id any member issued; the members that issued it ``joined``, the
  others are ``missing`` (they never called it);
- a rank that sent no dump is placed from its peers' view: a collective completes only once every member joined
  it, so it got at least as far as the highest sequence id completed on any peer (its ``last_collective``);
- the culprits are the missing ranks that do not themselves wait on a collective (they are elsewhere: stopped,
  dead, stuck in Python or compute); a missing rank that waits in another group is a victim of the chain, unless
  every missing rank waits (a cycle: ranks issued collectives in different orders), in which case all are named.

Point-to-point operations (pipeline ``send``/``recv``) have no collective sequence id and are not matched; they
still show as a rank's last operation.

A dump holds one trace per backend: ``trace`` (gloo's Flight Recorder) and ``nccl_trace`` (NCCL's, on a GPU world).
Each has its own process-group ids (``pg_id``, the key of its ``pg_status``); groups are matched across ranks by
name, which is unique in a process whatever the backend. NCCL's entries carry the collective's duration on the GPU
(``duration_ms``): a collective's ``duration_s`` in the analysis. ``load_trace`` reads a trace from the bytes torch
writes (its pickle, read without importing anything, or JSON), e.g. NCCL's own dump files.
"""

from __future__ import annotations

import io
import json
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from opsd.errors import BodyError
from opsd.protocol.flight_analysis import Collective, Culprit, FlightAnalysis, StuckGroup
from opsd.protocol.flight_dump import FlightDump, FlightEntry, FlightFrame, FlightGroup

NS_PER_S = 1e9
MS_PER_S = 1e3


class _PlainUnpickler(pickle.Unpickler):
    """Builds only what pickle makes without naming a class (dicts, lists, tuples, strings, numbers, None): torch's
    Flight Recorder pickle needs nothing else, and a file that asks for anything more is refused, never run."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a Flight Recorder trace names no class ({module}.{name})")


def load_trace(data: bytes) -> dict[str, Any]:
    """A Flight Recorder trace from the bytes torch writes: its pickle (``_dump_fr_trace``, ``_dump_nccl_trace``,
    NCCL's dump files) or JSON (the ``_json`` variants, or the JSON values of either). Raises ``BodyError``."""
    try:
        value = json.loads(data) if data.lstrip()[:1] == b"{" else _PlainUnpickler(io.BytesIO(data)).load()
    except (ValueError, pickle.UnpicklingError, EOFError, IndexError, TypeError) as exc:
        raise BodyError(f"not a Flight Recorder trace (pickle or JSON): {exc}") from None
    if not isinstance(value, dict):
        raise BodyError(f"not a Flight Recorder trace: a {type(value).__name__}, not an object")
    return {str(k): _plain(v) for k, v in value.items()}


def _plain(value: Any) -> Any:
    """Tuples as lists and keys as strings, as in JSON."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


@dataclass
class GroupSeen:
    """One process group as one rank's dump shows it."""

    name: str  # the process group's name (``pg_id`` in the analysis: the same on every member)
    label: str  # what to call it: the mesh dimension, else the description, else "pg <name>"
    ranks: tuple[int, ...]
    enqueued: int | None = None  # last sequence id issued, None when the buffer holds none of its collectives
    completed: int | None = None
    first_seq: int | None = None  # the oldest sequence id still in the buffer
    entries: dict[int, FlightEntry] = field(default_factory=dict)  # seq -> entry


@dataclass
class RankSeen:
    rank: int
    groups: dict[tuple[str, tuple[int, ...]], GroupSeen]
    last: tuple[GroupSeen, FlightEntry] | None  # its newest entry, of any group, and its group
    stack: str | None


def _ranks(value: list[int] | str) -> tuple[int, ...] | None:
    """A group's members: a list, or the text of one (NCCL's ``pg_config`` writes ``"[0, 1]"``)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in value):
        return None
    return tuple(sorted(set(value)))


def _label(name: str, info: FlightGroup) -> str:
    if info.dim and info.dim != "other":
        return info.dim
    if info.desc and info.desc != "undefined":  # torch's description of a group given none
        return info.desc.removeprefix("mesh_")
    return f"pg {name}"


def _op(entry: FlightEntry | None) -> str:
    """``gloo:all_reduce`` -> ``all_reduce``; NCCL's ``nccl:_all_gather_base`` -> ``all_gather``, ``nccl:send 0->1``
    -> ``send``."""
    words = entry.profiling_name.rsplit(":", 1)[-1].split() if entry is not None else []
    return words[0].strip("_").removesuffix("_base") if words else "unknown"


def format_frames(frames: list[FlightFrame]) -> str | None:
    """A Flight Recorder entry's frames (innermost first) as a traceback (outermost first)."""
    lines = [f'  File "{f.filename or "?"}", line {f.line}, in {f.name or "?"}\n' for f in reversed(frames)]
    return "".join(lines) or None


def read_dump(rank: int, dump: FlightDump, world: tuple[int, ...]) -> RankSeen:
    """What one rank's dump says, per process group, over its backends' traces."""
    config: dict[str, FlightGroup] = {}
    for trace in dump.traces:
        config.update(trace.pg_config)
    groups: dict[str, GroupSeen] = {}

    def group(name: str, desc: str = "") -> GroupSeen:
        if name not in groups:
            info = dump.groups.get(name) or config.get(name) or FlightGroup(desc=desc)
            ranks = _ranks(info.ranks)
            if ranks is None:
                ranks = world if (info.desc or desc) == "default_pg" else (rank,)
            named = info if info.desc else msgspec.structs.replace(info, desc=desc)  # the entry's when none other
            groups[name] = GroupSeen(name, _label(name, named), ranks)
        return groups[name]

    for name in dump.groups:
        group(name)
    last: tuple[GroupSeen, FlightEntry] | None = None
    for trace in dump.traces:
        pg_names: dict[str, str] = {}  # pg_id (a per-process counter of the backend) -> name
        for e in sorted(trace.entries, key=lambda e: e.record_id):
            g = group(*e.process_group)
            pg_names[str(e.pg_id)] = g.name
            if last is None or e.time_created_ns >= last[1].time_created_ns:
                last = (g, e)
            seq = e.collective_seq_id
            if e.is_p2p or seq <= 0:
                continue
            g.entries[seq] = e
            g.enqueued = max(g.enqueued or 0, seq)
            g.first_seq = seq if g.first_seq is None else min(g.first_seq, seq)
            if e.state == "completed" or e.retired:
                g.completed = max(g.completed or 0, seq)
        for pg_id, status in trace.pg_status.items():
            named = pg_names.get(pg_id)
            if named is None:
                continue
            g = groups[named]
            enqueued, completed = status.last_enqueued_collective, status.last_completed_collective
            if enqueued is not None and enqueued > 0:
                g.enqueued = max(g.enqueued or 0, enqueued)
            if completed is not None and completed >= 0:
                g.completed = completed  # the process group's own count wins over the entries' states
    stack = dump.stack
    if stack is None and last is not None:
        stack = format_frames(last[1].frames)
    return RankSeen(rank, {(g.name, g.ranks): g for g in groups.values()}, last, stack)


def _collective(g: GroupSeen, seq: int, entry: FlightEntry, completed: int | None) -> Collective:
    state = "completed" if completed is not None and seq <= completed else entry.state
    created = entry.time_created_ns
    duration_ms = entry.duration_ms  # NCCL's, once the collective completed on the GPU (gloo has none)
    duration_s = duration_ms / MS_PER_S if duration_ms is not None else None
    return Collective(
        group=g.label,
        pg_id=g.name,
        seq=seq,
        op=_op(entry),
        state=state,
        time_unix_s=created / NS_PER_S if created else None,
        duration_s=duration_s,
    )


def _waiting(seen: RankSeen, done: dict[tuple[str, tuple[int, ...]], int]) -> list[tuple[GroupSeen, int]]:
    """The collectives a rank issued that no member of their group has seen complete: (group, seq). One that a
    peer saw complete is over for this rank too, whether or not it noticed yet."""
    out = []
    for key, g in seen.groups.items():
        if g.enqueued is not None and len(g.ranks) > 1 and g.enqueued > max(done.get(key, 0), g.completed or 0):
            out.append((g, g.enqueued))
    return out


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def analyze(
    dumps: Mapping[int, FlightDump], ranks_expected: list[int], trigger: str, incident_id: int | None
) -> FlightAnalysis:
    """The analysis of one trigger's dumps (docs/flight-recorder.md): the process groups stuck, and the culprits."""
    world = tuple(sorted(set(ranks_expected) | set(dumps)))
    seen = {rank: read_dump(rank, dump, world) for rank, dump in sorted(dumps.items())}

    # every group any rank saw, by (name, members): its view from each member that dumped
    views: dict[tuple[str, tuple[int, ...]], dict[int, GroupSeen]] = {}
    for rank, s in seen.items():
        for key, g in s.groups.items():
            views.setdefault(key, {})[rank] = g

    groups_out: list[StuckGroup] = []
    missing_from: dict[int, list[StuckGroup]] = {}  # rank -> the stuck groups it is missing from
    peer_view: dict[int, list[tuple[GroupSeen, int, FlightEntry]]] = {}  # not dumped: (group, seq, entry)
    for (name, members), by_rank in sorted(views.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if len(members) < 2:
            continue
        known = {r: g.enqueued for r, g in by_rank.items() if g.enqueued is not None}
        # a member whose buffer holds none of the group's collectives, while a peer's holds them from the first
        from_start = any(g.first_seq == 1 for g in by_rank.values())
        for r, g in by_rank.items():
            if g.enqueued is None and from_start:
                known[r] = 0
        if not known:
            continue
        top = max(known.values())
        done = max((g.completed for g in by_rank.values() if g.completed is not None), default=0)
        last_seq = {r: seq for r, seq in known.items() if r in members}
        for r in members:
            if r not in seen and done > 0:  # it joined every collective completed on a peer
                last_seq[r] = done
                holder = next((g for g in by_rank.values() if done in g.entries), None)
                if holder is not None:
                    peer_view.setdefault(r, []).append((holder, done, holder.entries[done]))
        joined = sorted(r for r, seq in last_seq.items() if seq >= top)
        # a member that dumped but whose buffer no longer holds this group's collectives is not known to lag
        missing = sorted(r for r in members if r not in joined and (r not in seen or r in known))
        if not missing or top <= 0:
            continue
        holder = next(g for r, g in by_rank.items() if r in joined)
        entry = holder.entries.get(top)
        record = StuckGroup(
            group=holder.label,
            pg_id=name,
            ranks=tuple(members),
            stuck_seq=top,
            op=_op(entry),
            joined=tuple(joined),
            missing=tuple(missing),
            last_seq_by_rank={str(r): last_seq[r] for r in sorted(last_seq)},
        )
        groups_out.append(record)
        for r in missing:
            missing_from.setdefault(r, []).append(record)

    done_by_group = {
        key: max((g.completed for g in by_rank.values() if g.completed is not None), default=0)
        for key, by_rank in views.items()
    }
    groups_out.sort(key=lambda g: (g.group, g.pg_id or ""))
    waiting = {rank: _waiting(s, done_by_group) for rank, s in seen.items()}
    suspects = sorted(missing_from)
    culprits_ranks = [r for r in suspects if r not in seen or not waiting[r]]
    cycle = bool(suspects) and not culprits_ranks
    if cycle:
        culprits_ranks = suspects
    if not groups_out:  # nothing waits: a rank asked for a dump that sent none is the one lead there is
        culprits_ranks = [r for r in ranks_expected if r not in seen]

    culprits = []
    for r in culprits_ranks:
        culprits.append(
            _culprit(r, seen.get(r), missing_from.get(r, []), peer_view.get(r, []), waiting, r in ranks_expected, cycle)
        )
    summary = _summary(culprits_ranks, missing_from, groups_out, seen, ranks_expected, cycle, waiting)
    return FlightAnalysis(
        trigger=trigger,
        incident_id=incident_id,
        ranks_expected=tuple(sorted(ranks_expected)),
        ranks_dumped=tuple(sorted(seen)),
        culprits=tuple(culprits),
        groups=tuple(groups_out),
        summary=summary,
    )


def _by_waiting(g: StuckGroup) -> tuple[int, str, str]:
    """The order of stuck groups: the one most ranks wait in first."""
    return (-len(g.joined), g.group, g.pg_id or "")


def _main_group(records: list[StuckGroup]) -> StuckGroup:
    """Of the stuck groups a rank is missing from, the one most ranks wait in."""
    return sorted(records, key=_by_waiting)[0]


def _culprit(
    rank: int,
    s: RankSeen | None,
    records: list[StuckGroup],
    peers: list[tuple[GroupSeen, int, FlightEntry]],
    waiting: dict[int, list[tuple[GroupSeen, int]]],
    expected: bool,
    cycle: bool,
) -> Culprit:
    what = "; ".join(
        f"never joined {r.op} #{r.stuck_seq} of group {r.group} (pg {r.pg_id})"
        for r in sorted(records, key=_by_waiting)
    )
    last: Collective | None = None
    if s is None:
        if peers:
            g, seq, entry = max(peers, key=lambda p: p[2].time_created_ns)
            last = _collective(g, seq, entry, seq)
        if expected:
            reason = f"sent no dump: {what}" if what else "sent no dump"
        else:
            reason = f"{what} (seen from its peers)" if what else "no dump"
    else:
        if s.last is not None:
            g, entry = s.last
            if entry.is_p2p:  # no collective sequence: its own id and state
                done = entry.state == "completed" or entry.retired
                last = _collective(g, entry.p2p_seq_id, entry, entry.p2p_seq_id if done else None)
            else:
                last = _collective(g, entry.collective_seq_id, entry, g.completed)
        if cycle and waiting.get(rank):
            g, seq = waiting[rank][0]
            op = _op(g.entries.get(seq))
            reason = f"{what}: it waits in {op} #{seq} of group {g.label} (pg {g.name}) itself (a cycle)"
        else:
            reason = f"{what}: it waits on no collective" if what else "waits on no collective"
    return Culprit(rank=rank, reason=reason, last_collective=last, stack=s.stack if s is not None else None)


def _summary(
    culprits: list[int],
    missing_from: dict[int, list[StuckGroup]],
    groups: list[StuckGroup],
    seen: dict[int, RankSeen],
    expected: list[int],
    cycle: bool,
    waiting: dict[int, list[tuple[GroupSeen, int]]],
) -> str:
    if not seen:
        return "no rank sent a dump"
    if not groups:
        silent = [r for r in expected if r not in seen]
        if silent:
            return (
                f"rank(s) {_ranks_text(silent)} sent no dump; the {len(seen)} that did wait on no collective of "
                "each other"
            )
        busy = sorted(r for r, w in waiting.items() if w)
        tail = f" (ranks {_ranks_text(busy)} have a collective in flight that all members joined)" if busy else ""
        return f"every rank that dumped joined every collective of its groups: no culprit{tail}"
    texts = []
    for r in culprits[:4]:
        records = missing_from.get(r, [])
        if not records:
            texts.append(f"rank {r} sent no dump")
            continue
        g = _main_group(records)
        who = _ranks_text(list(g.joined))
        text = f"rank {r} never joined {g.op} #{g.stuck_seq} on {g.group}: ranks {who} wait for it"
        if r not in seen:
            text += " (it sent no dump)"
        texts.append(text)
    if len(culprits) > 4:
        texts.append(f"and {len(culprits) - 4} more ranks")
    prefix = "a cycle: " if cycle else ""
    return prefix + "; ".join(texts)
