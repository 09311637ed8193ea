"""The controller's post-mortem bundle (``GET /v1/runs/{run}/postmortem``, docs/postmortem.md) as the post-mortem
reads it: typed structs decoded and checked in one pass by msgspec. Fields the post-mortem does not read are
ignored; a bundle that does not follow the document is refused with a ``PermanentError`` naming the field's path
(``post-mortem bundle: Expected `int`, got `str` - at `$.incidents[3].rank```)."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from opsd.errors import PermanentError
from opsd.postmortem.model import Checkpoint, Collective, Culprit, FlightRecorder, StuckGroup
from opsd.protocol.states import ActionKind
from opsd.protocol.steps import Result, Step, result_of, step_of

KNOWN_KINDS = frozenset(k.value for k in ActionKind)

_MAX = sys.float_info.max
_BOUNDS = (f"`float` >= {-_MAX!r}", f"`float` <= {_MAX!r}")
Finite = Annotated[float, Meta(ge=-_MAX, le=_MAX)]  # NaN and the infinities refused
Seconds = Annotated[float, Meta(ge=0, le=_MAX)]


# -- a Flight Recorder analysis (opsd.analysis.flight_recorder) ---------------------------------------------------
class CollectiveIn(Struct, frozen=True, kw_only=True):
    group: str | None = None
    pg_id: str | int | None = None
    seq: int | None = None
    op: str | None = None
    state: str | None = None
    time_unix_s: Finite | None = None
    duration_s: Finite | None = None

    def model(self) -> Collective:
        pg = None if self.pg_id is None else str(self.pg_id)
        return Collective(self.group, pg, self.seq, self.op, self.state, self.time_unix_s, self.duration_s)


class CulpritIn(Struct, frozen=True, kw_only=True):
    rank: int | None = None
    reason: str = ""
    last_collective: CollectiveIn | None = None
    stack: str | None = None


class GroupIn(Struct, frozen=True, kw_only=True):
    group: str = "?"
    pg_id: str | int | None = None
    ranks: tuple[int, ...] = ()
    stuck_seq: int | None = None
    op: str | None = None
    joined: tuple[int, ...] = ()
    missing: tuple[int, ...] = ()


class AnalysisIn(Struct, frozen=True, kw_only=True):
    trigger: str | None = None
    incident_id: int | None = None
    ranks_expected: tuple[int, ...] = ()
    ranks_dumped: tuple[int, ...] = ()
    culprits: tuple[CulpritIn, ...] = ()
    groups: tuple[GroupIn, ...] = ()
    summary: str = ""

    def model(self, trigger: str) -> FlightRecorder:
        """The analysis as the report shows it; ``trigger``: its key in the bundle, when it names none itself."""
        culprits = tuple(
            Culprit(c.rank, c.reason, c.last_collective.model() if c.last_collective else None, c.stack)
            for c in self.culprits
        )
        groups = tuple(
            StuckGroup(
                g.group, None if g.pg_id is None else str(g.pg_id), g.ranks, g.stuck_seq, g.op, g.joined, g.missing
            )
            for g in self.groups
        )
        expected, dumped = self.ranks_expected, self.ranks_dumped
        return FlightRecorder(
            self.trigger or trigger, self.incident_id, expected, dumped, culprits, groups, self.summary
        )


# -- the run, its incidents, the actions of their recoveries, its checkpoints ---------------------------------------
class RunIn(Struct, frozen=True, kw_only=True):
    id: Annotated[str, Meta(min_length=1)]
    state: str | None = None
    created_s: Finite | None = None
    updated_s: Finite | None = None
    generation: int | None = None
    last_step: int | None = None
    final_step: int | None = None


class IncidentIn(Struct, frozen=True, kw_only=True):
    id: int
    key: str = ""
    kind: str
    node: str = "?"
    rank: int | None = None
    detail: str = ""
    state: str = "unknown"
    failed_s: Finite | None = None
    detected_s: Finite | None = None
    resumed_s: Finite | None = None
    resumed_from_step: int | None = None
    lost_steps: int | None = None
    spare: str | None = None
    trace_id: str | None = None
    replica_group: int | None = None
    missed_steps: int | None = None
    stall_s: Finite | None = None


class ActionIn(Struct, frozen=True, kw_only=True):
    incident_id: int | None = None
    seq: int = 0
    kind: str
    args: dict[str, Any] = {}
    state: str = "?"
    created_s: Finite | None = None
    done_s: Finite | None = None
    result: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.result is not None and self.kind in KNOWN_KINDS:  # a newer controller's own kinds are not read
            try:
                result_of(self.kind, self.result)
            except PermanentError as exc:
                raise ValueError(str(exc)) from None

    def outcome(self) -> Result | None:
        """What it did, as its ``result`` records (None: not done, or a kind this version does not know)."""
        if self.result is None or self.kind not in KNOWN_KINDS:
            return None
        return result_of(self.kind, self.result)

    def step(self) -> Step | None:
        """The step its ``kind`` and ``args`` record (None: they make none this version knows)."""
        try:
            return step_of(self.kind, self.args)
        except PermanentError:
            return None


class CheckpointIn(Struct, frozen=True, kw_only=True):
    step: int
    state: str = "unknown"
    problem: str | None = None
    bytes: int | None = None
    time_unix_s: Finite | None = None

    def model(self) -> Checkpoint:
        return Checkpoint(self.step, self.state, self.problem, self.bytes, self.time_unix_s)


# -- goodput, MTBF and each launch's collectives -------------------------------------------------------------------
class PipelineIn(Struct, frozen=True, kw_only=True):
    bubble_ratio: Finite
    theoretical_ratio: Finite | None = None
    schedule: str = ""
    stages: int | None = None
    microbatches: int | None = None


class MeasuredIn(Struct, frozen=True, kw_only=True):
    launch: int | None = None
    mfu_ratio: Finite | None = None
    tokens_per_s: Finite | None = None
    pipeline: PipelineIn | None = None
    pipeline_launch: int | None = None


class AverageIn(Struct, frozen=True, kw_only=True):
    mfu_ratio: Finite | None = None
    tokens_per_s: Finite | None = None
    bubble_ratio: Finite | None = None


class NodeIn(Struct, frozen=True, kw_only=True):
    name: str = "?"
    role: str | None = None
    reason: str = ""


class StatusIn(Struct, frozen=True, kw_only=True):
    ettr: Finite | None = None
    badput_s: dict[str, Seconds | None] | None = None
    mtbf_s: Finite | None = None
    mfu_ratio: Finite | None = None
    tokens_per_s: Finite | None = None
    last_measured: MeasuredIn | None = None
    run_average: AverageIn | None = None
    pipeline: PipelineIn | None = None
    nodes: tuple[NodeIn, ...] = ()


class BlockingIn(Struct, frozen=True, kw_only=True):
    count: int | None = None
    mean_s: Finite | None = None
    max_s: Finite | None = None


class PriorIn(Struct, frozen=True, kw_only=True):
    node_mtbf_h: Finite | None = None
    node_hours: Finite | None = None


class MtbfIn(Struct, frozen=True, kw_only=True):
    mtbf_s: Finite | None = None
    node_mtbf_h: Finite | None = None
    failures: int | None = None
    node_hours: Finite | None = None
    nodes: int | None = None
    prior: PriorIn = PriorIn()


class LaunchIn(Struct, frozen=True, kw_only=True):
    generation: int | None
    comm: dict[str, Finite | None] | None = None


class XidIn(Struct, frozen=True, kw_only=True):
    meaning: str | None = None
    action: str | None = None


class Bundle(Struct, frozen=True, kw_only=True):
    generated_unix_s: Finite  # "now"
    run: RunIn
    status: StatusIn | None
    incidents: tuple[IncidentIn, ...] | None
    actions: tuple[ActionIn, ...] | None
    checkpoints: tuple[CheckpointIn, ...] | None
    checkpoint_blocking_s: BlockingIn | None = None
    flight_recorder: dict[str, AnalysisIn] | None = None
    xid_table: dict[str, XidIn] | None = None
    mtbf: MtbfIn | None = None  # older bundles: the status's mtbf_s alone
    launches: tuple[LaunchIn, ...] | None = None  # absent from older bundles


def read_bundle(raw: Any) -> Bundle:
    """The bundle from its decoded JSON; PermanentError naming the path of a field that is wrong."""
    try:
        return msgspec.convert(raw, Bundle)
    except msgspec.ValidationError as exc:
        message = str(exc)
        for bound in _BOUNDS:  # the finite numbers' bounds, in words
            message = message.replace(bound, "finite `float`")
        raise PermanentError(f"post-mortem bundle: {message}") from None
