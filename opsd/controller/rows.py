"""The rows of the controller's state store, typed: a run and its spec, a launch's record and what it measured, a
run's published cadence, a Flight Recorder dump (a node, an incident and a recovery's action are the API's records
too, which the CLI and the post-mortem decode: ``opsd.protocol.records``). The store
(``opsd.controller.state``) reads and writes them; the controller, the backends' runners and the API take them as
they are (the API answers them as JSON: every field is a JSON value, enums as their strings).

Frozen: a row is what the store held when it was read. To change one, the store is told (``update_run``,
``upsert_node``, ...) and read again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

import msgspec

from opsd.errors import BodyError
from opsd.policy.cadence import Cadence
from opsd.policy.pipeline import RunBubble
from opsd.policy.recovery import OnNoSpare
from opsd.policy.replicas import ReplicaGroups
from opsd.protocol.answers import PipelineBubble
from opsd.protocol.states import RunState

log = logging.getLogger(__name__)
S = TypeVar("S", bound=msgspec.Struct)


@dataclass(frozen=True, slots=True)
class RunSpec:
    """What a run was started with, as the state store keeps it (JSON; fields unknown to this version are ignored,
    missing ones take their defaults): what every backend's runs have, and ``own``, the backend's own part (a
    struct of the backend's, ``own_as`` reads it back; e.g. the local backend's nodes and spares, the JobSet of a
    cluster's run). A run first heard of in a heartbeat, with no backend: ``observed``."""

    backend: str = ""
    checkpoint_url: str = ""
    on_no_spare: OnNoSpare = OnNoSpare.WAIT
    min_nodes: int = 1
    observed: bool = False
    replica_groups: int = 1  # fault-tolerant replica groups (torchft), each a launch of its own; 1: none
    min_replicas: int = 1  # the fewest groups that keep a quorum
    own: dict[str, object] = field(default_factory=dict)  # the backend's part, as JSON (``own_as``, ``with_own``)

    @property
    def replicas(self) -> ReplicaGroups:
        return ReplicaGroups(self.replica_groups, self.min_replicas)

    def own_as(self, kind: type[S]) -> S:
        """The backend's part as its struct; ``BodyError`` when what is kept does not fit it."""
        try:
            return msgspec.convert(self.own, kind)
        except msgspec.ValidationError as exc:
            raise BodyError(f"a {self.backend or 'run'} spec's own part does not fit {kind.__name__}: {exc}") from None

    def with_own(self, part: msgspec.Struct) -> RunSpec:
        """This spec with ``part`` (a struct of its backend's) as its own part."""
        return replace(self, own=msgspec.to_builtins(part))


@dataclass(frozen=True, slots=True)
class GroupLaunch:
    """A replica group of a fault-tolerant run, as the store keeps it: the launch it was last launched at (the one
    its ranks report, ``OPSD_LAUNCH``: the generation, or the backend's own number for the group when it names one,
    as a cluster's count of the group's Job restarts), on which nodes, and whether it is out of the quorum waiting
    for a node (the run goes on without it)."""

    launch: int
    nodes: tuple[str, ...]
    out: bool = False


_SPEC_DECODER = msgspec.json.Decoder(RunSpec)
_SPEC_FIELDS = frozenset(f.name for f in fields(RunSpec))
_GROUPS_DECODER = msgspec.json.Decoder(dict[int, GroupLaunch])


def decode_spec(data: str | bytes) -> RunSpec:
    """A spec as the store keeps it; one that does not fit (a hand-edited store) reads as an empty spec rather than
    failing every read of its run."""
    try:
        stored = msgspec.json.decode(data)
        if isinstance(stored, dict) and "own" not in stored:  # a store before the backends' own parts: theirs then
            own = {k: v for k, v in stored.items() if k not in _SPEC_FIELDS and v not in (None, "")}
            return msgspec.convert({**{k: v for k, v in stored.items() if k in _SPEC_FIELDS}, "own": own}, RunSpec)
        return _SPEC_DECODER.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError):
        log.warning("a run's spec in the state store does not fit (%r): read as empty", data[:200])
        return RunSpec()


def encode_spec(spec: RunSpec) -> str:
    return msgspec.json.encode(spec).decode()


def decode_groups(data: str | bytes | None) -> dict[int, GroupLaunch]:
    """A run's replica groups as the store keeps them (none for a run without groups, or a store before them)."""
    if not data:
        return {}
    try:
        return _GROUPS_DECODER.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError):
        log.warning("a run's replica groups in the state store do not fit (%r): read as none", data[:200])
        return {}


def encode_groups(groups: dict[int, GroupLaunch]) -> str:
    return msgspec.json.encode(groups).decode()


@dataclass(frozen=True)
class LaunchSample:
    """What a launch measured, as of now (``StateStore.record_launch``)."""

    first_step: int | None = None
    last_step: int | None = None
    ranks: int = 0
    progressed: bool = False  # it stepped since the last sample: ``mfu_ratio`` and ``tokens_per_s`` count
    mfu_ratio: float = 0.0
    tokens_per_s: float = 0.0
    comm: dict[str, float] = field(default_factory=dict)  # "phase;dimension;op" -> seconds of this launch
    pipeline: PipelineBubble | None = None  # its pipeline bubble now (``pipeline_view``), when its ranks report one


@dataclass(frozen=True, slots=True)
class PublishedCadence:
    """The checkpoint cadence last published to a run's ranks and the one it replaced (their policy's ``checkpoint``
    and its ``previous``), as the store keeps it: a controller started again, or one that takes over, replaces it
    as the one before would have, keeping the rule in force (docs/protocol.md)."""

    current: Cadence
    previous: Cadence | None = None


_CADENCE_DECODER = msgspec.json.Decoder(PublishedCadence)


def decode_cadence(data: str | bytes | None) -> PublishedCadence | None:
    """A run's published cadence as the store keeps it (None: none published, or a store before them)."""
    if not data:
        return None
    try:
        return _CADENCE_DECODER.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError):
        log.warning("a run's cadence in the state store does not fit (%r): read as none", data[:200])
        return None


def encode_cadence(cadence: PublishedCadence) -> str:
    return msgspec.json.encode(cadence).decode()


_BUBBLE_DECODER = msgspec.json.Decoder(PipelineBubble)


def decode_bubble(data: str | bytes | None) -> PipelineBubble | None:
    """A launch's last pipeline bubble as the store keeps it (None: none, or one that does not fit)."""
    if not data:
        return None
    try:
        return _BUBBLE_DECODER.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError):
        log.warning("a launch's pipeline bubble in the state store does not fit (%r): read as none", data[:200])
        return None


def as_json(value: Any) -> Any:
    """Rows (and what holds them) as JSON values: dataclasses as objects, enums as their strings."""
    return msgspec.to_builtins(value)


@dataclass(frozen=True, slots=True)
class RunRow:
    id: str
    state: RunState
    spec: RunSpec
    created_s: float
    updated_s: float
    generation: int  # launches so far (0: not launched)
    last_step: int  # the newest step its ranks reported, of any launch
    final_step: int | None  # where a finished run ended
    first_productive_s: float | None  # its first productive step (the end of its launch and initialisation)
    groups: dict[int, GroupLaunch] = field(default_factory=dict)  # a fault-tolerant run's replica groups
    cadence: PublishedCadence | None = None  # the checkpoint cadence last published to its ranks

    def active_groups(self) -> list[int]:
        """The replica groups in service (not out waiting for a node)."""
        return sorted(g for g, launch in self.groups.items() if not launch.out)

    def group_of(self, node: str) -> int | None:
        """The replica group ``node`` was last launched in, if any."""
        return next((g for g, launch in self.groups.items() if node in launch.nodes), None)


@dataclass(frozen=True, slots=True)
class LaunchRow:
    """What a launch of a run measured (``StateStore.record_launch``)."""

    run: str
    generation: int
    started_s: float  # first recorded
    updated_s: float
    first_step: int | None  # the first and newest steps its ranks reported
    last_step: int | None
    ranks: int  # heard from, at most
    samples: int  # samples taken while it progressed: the sums below are over them
    mfu_ratio_sum: float
    tokens_per_s_sum: float
    mfu_ratio_last: float | None
    tokens_per_s_last: float | None
    comm: dict[str, float] = field(default_factory=dict)  # "phase;dimension;op" -> seconds: its collectives
    pipeline: PipelineBubble | None = None  # its last pipeline bubble, as the run's status has it
    bubble_ratio_sum: float | None = None
    bubble_samples: int | None = None


@dataclass(frozen=True, slots=True)
class FlightDumpRow:
    run: str
    trigger: str  # incident-<id>, timeout-<rank>-<step>, or a command's id
    rank: int
    incident_id: int | None
    received_s: float
    body: str  # the dump as the rank wrote it (JSON; docs/flight-recorder.md)


def pipeline_view(bubble: RunBubble | None) -> PipelineBubble | None:
    """The run's pipeline bubble as ``status`` answers it: measured (the mean of the ranks' last steps, and per
    stage), the theory of its schedule and the margin the alert allows; None when no rank reports a pipeline."""
    if bubble is None:
        return None
    return PipelineBubble(
        bubble_ratio=bubble.measured_ratio,
        theoretical_ratio=bubble.theoretical_ratio,
        margin_ratio=bubble.margin_ratio,
        over_theory=bubble.over_theory,
        schedule=bubble.schedule,
        stages=bubble.stages,
        microbatches=bubble.micro_batches,
        stage_ratios={str(stage): ratio for stage, ratio in bubble.stage_ratios.items()},
    )
