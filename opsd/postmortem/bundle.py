"""The controller's post-mortem bundle (``GET /v1/runs/{run}/postmortem``, docs/postmortem.md) as the post-mortem
reads it: typed structs decoded and checked in one pass by msgspec. Fields the post-mortem does not read are
ignored; a bundle that does not follow the document is refused with a ``PermanentError`` naming the field's path
(``post-mortem bundle: Expected `int`, got `str` - at `$.incidents[3].rank```)."""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta, Struct

from opsd.errors import PermanentError
from opsd.protocol.answers import CheckpointEntry, Mtbf, RunStatus, decode_answer
from opsd.protocol.fields import Finite
from opsd.protocol.flight_analysis import FlightAnalysis
from opsd.protocol.states import ActionKind
from opsd.protocol.steps import Result, Step, result_of, step_of

KNOWN_KINDS = frozenset(k.value for k in ActionKind)


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


# -- goodput, MTBF and each launch's collectives -------------------------------------------------------------------
class BlockingIn(Struct, frozen=True, kw_only=True):
    count: int | None = None
    mean_s: Finite | None = None
    max_s: Finite | None = None


class LaunchIn(Struct, frozen=True, kw_only=True):
    generation: int | None
    comm: dict[str, Finite | None] | None = None


class XidIn(Struct, frozen=True, kw_only=True):
    meaning: str | None = None
    action: str | None = None


class Bundle(Struct, frozen=True, kw_only=True):
    generated_unix_s: Finite  # "now"
    run: RunIn
    status: RunStatus | None
    incidents: tuple[IncidentIn, ...] | None
    actions: tuple[ActionIn, ...] | None
    checkpoints: tuple[CheckpointEntry, ...] | None
    checkpoint_blocking_s: BlockingIn | None = None
    flight_recorder: dict[str, FlightAnalysis] | None = None
    xid_table: dict[str, XidIn] | None = None
    mtbf: Mtbf | None = None  # older bundles: the status's mtbf_s alone
    launches: tuple[LaunchIn, ...] | None = None  # absent from older bundles


def read_bundle(raw: Any) -> Bundle:
    """The bundle from its decoded JSON; PermanentError naming the path of a field that is wrong."""
    return decode_answer(raw, Bundle, "post-mortem bundle")
