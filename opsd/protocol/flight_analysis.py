"""The analysis of a trigger's Flight Recorder dumps (docs/flight-recorder.md), typed: the process groups stuck, the
ranks that hold them up (the culprits) and why, and a summary in one line. ``opsd.analysis.flight_recorder`` makes
it, the controller keeps and answers it (``GET /v1/runs/{run}/flight-recorder``, the post-mortem bundle), a
recovery reads its culprits, and the post-mortem shows it: one struct for all of them."""

from __future__ import annotations

from msgspec import Struct

from opsd.protocol.fields import Finite


class Collective(Struct, frozen=True, kw_only=True):
    """One collective of a process group as a rank's dump recorded it: its group (label and process group id), its
    sequence number, op and state, when it was created, and its time on the GPU (NCCL's, once completed)."""

    group: str | None = None
    pg_id: str | None = None
    seq: int | None = None
    op: str | None = None
    state: str | None = None
    time_unix_s: Finite | None = None
    duration_s: Finite | None = None


class Culprit(Struct, frozen=True, kw_only=True):
    """A rank that holds the others up: why, its last collective, and the stack its dump holds."""

    rank: int | None = None
    reason: str = ""
    last_collective: Collective | None = None
    stack: str | None = None


class StuckGroup(Struct, frozen=True, kw_only=True):
    """A process group some of whose members wait in collective ``stuck_seq`` that others (``missing``) never
    joined; ``last_seq_by_rank``: the last collective each member is known to have joined."""

    group: str = "?"
    pg_id: str | None = None
    ranks: tuple[int, ...] = ()
    stuck_seq: int | None = None
    op: str | None = None
    joined: tuple[int, ...] = ()
    missing: tuple[int, ...] = ()
    last_seq_by_rank: dict[str, int] = {}


class FlightAnalysis(Struct, frozen=True, kw_only=True):
    """The analysis of the dumps of one trigger (``incident-<id>``, ``timeout-<rank>-<step>``, a command's id)."""

    trigger: str | None = None
    incident_id: int | None = None
    ranks_expected: tuple[int, ...] = ()
    ranks_dumped: tuple[int, ...] = ()
    culprits: tuple[Culprit, ...] = ()
    groups: tuple[StuckGroup, ...] = ()
    summary: str = ""


#: a run's analyses by trigger (``GET /v1/runs/{run}/flight-recorder``)
FlightAnalyses = dict[str, FlightAnalysis]
