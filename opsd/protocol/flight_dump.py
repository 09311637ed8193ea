"""A rank's Flight Recorder dump (docs/flight-recorder.md), typed: what the trainer hooks write
(``trainer_hooks.flight``: torch's traces as its dump functions return them, and the rank's process groups and
Python stack), what the
controller takes (``POST /v1/runs/{run}/flight-recorder``: a body that does not fit is refused, naming the field),
keeps as it was sent, and analyses (``opsd.analysis.flight_recorder``): one struct for all three.

The traces are torch's (``_dump_fr_trace``, ``_dump_nccl_trace``): the fields read here are typed, the others are
kept in the body as sent and not decoded. Numbers given as text are taken (``decode_dump`` is lax about types, as
torch's JSON variants write some numbers as strings)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

from opsd.errors import BodyError
from opsd.protocol.fields import Count, Finite, Name

Text = Annotated[str, Meta(max_length=1000)]
GroupName = Annotated[str, Meta(max_length=200)]
Trigger = Annotated[str, Meta(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$(?!\n)")]


class FlightFrame(Struct, frozen=True, kw_only=True):
    """A frame of the Python stack that issued a collective (innermost first in its entry)."""

    name: Text = ""
    filename: Text = ""
    line: int = 0


class FlightEntry(Struct, frozen=True, kw_only=True):
    """A Flight Recorder entry: one collective (or point-to-point operation) of a process group."""

    record_id: Count
    pg_id: Count = 0  # the backend's per-process number of the group (the key of its trace's ``pg_status``)
    process_group: tuple[GroupName, GroupName]  # the group's name and description
    collective_seq_id: Count = 0  # its sequence id in the group, the same on every member (0: none)
    p2p_seq_id: Count = 0
    is_p2p: bool = False
    profiling_name: Annotated[str, Meta(max_length=200)] = ""  # "gloo:all_reduce", "nccl:_all_gather_base"
    time_created_ns: Count = 0
    duration_ms: Annotated[float, Meta(ge=0)] | None = None  # NCCL's time on the GPU, once completed
    state: Annotated[str, Meta(max_length=32)] = "scheduled"  # scheduled, started, completed
    retired: bool = False
    frames: Annotated[list[FlightFrame], Meta(max_length=1000)] = []


class FlightGroup(Struct, frozen=True, kw_only=True):
    """A process group as a rank declares it (the dump's ``groups``) or a trace configures it (``pg_config``):
    its description, its global ranks (a list, or NCCL's text of one: ``"[0, 1]"``), the mesh dimension of its
    label."""

    name: GroupName = ""
    desc: GroupName = ""
    ranks: Annotated[list[Count], Meta(max_length=10_000_000)] | Annotated[str, Meta(max_length=1 << 20)] = []
    dim: Annotated[str, Meta(max_length=64)] = ""


class FlightGroupStatus(Struct, frozen=True, kw_only=True):
    """A process group's own counts: the last sequence id issued and the last completed (gloo's entries stay
    ``scheduled``: this is the only completion there is)."""

    last_enqueued_collective: int | None = None
    last_completed_collective: int | None = None


class FlightTrace(Struct, frozen=True, kw_only=True):
    """One backend's Flight Recorder trace."""

    version: Annotated[str, Meta(max_length=32)] = ""
    pg_config: dict[str, FlightGroup] = {}  # pg_id -> the group
    pg_status: dict[str, FlightGroupStatus] = {}  # pg_id -> its counts
    entries: Annotated[list[FlightEntry], Meta(max_length=1_000_000)] = []


class FlightDump(Struct, frozen=True, kw_only=True):
    """One rank's dump for a trigger; unknown fields are ignored."""

    v: Literal[1]
    run: Name
    trigger: Trigger  # incident-<id>, timeout-<rank>-<step>, or a command's id
    rank: Annotated[int, Meta(ge=0, le=10_000_000)]
    world_size: Annotated[int, Meta(ge=1, le=10_000_001)]
    host: Annotated[str, Meta(max_length=200)] = ""
    time_unix_s: Finite
    groups: dict[GroupName, FlightGroup] = {}  # this rank's process groups by name
    stack: Annotated[str, Meta(max_length=1 << 20)] | None = None  # the training thread's Python stack
    trace: FlightTrace  # gloo's Flight Recorder
    nccl_trace: FlightTrace | None = None  # NCCL's, on a GPU world

    def __post_init__(self) -> None:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is not below world_size {self.world_size}")

    @property
    def traces(self) -> tuple[FlightTrace, ...]:
        """Its backends' traces: gloo's, then NCCL's when there is one."""
        return (self.trace,) if self.nccl_trace is None else (self.trace, self.nccl_trace)


class DumpKept(Struct, frozen=True, kw_only=True):
    """The controller's answer to a dump: kept (``stored``), or a repeat of one kept already."""

    run: str
    trigger: str
    rank: int
    stored: bool


_DECODER = msgspec.json.Decoder(FlightDump, strict=False)


def decode_dump(data: bytes | str) -> FlightDump:
    """A dump from its JSON; ``BodyError`` naming the field (``$.nccl_trace.entries[3].record_id``) when it does
    not fit."""
    try:
        return _DECODER.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise BodyError(f"not a Flight Recorder dump: {exc}") from None


def as_dump(value: object) -> FlightDump:
    """A dump from decoded JSON values (``BodyError`` as ``decode_dump``)."""
    try:
        return msgspec.convert(value, FlightDump, strict=False)
    except msgspec.ValidationError as exc:
        raise BodyError(f"not a Flight Recorder dump: {exc}") from None
