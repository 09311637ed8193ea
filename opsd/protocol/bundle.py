"""The post-mortem bundle (``GET /v1/runs/{run}/postmortem``, docs/postmortem.md): everything a post-mortem of a run is
made of, in the types the API answers each part with. The controller builds it (``opsd.controller.views``), the
post-mortem decodes it (``read_bundle``: one pass, a field that is wrong refused with a ``PermanentError`` naming its
path, ``post-mortem bundle: Expected `int`, got `str` - at `$.incidents[3].rank```) and builds its report from it.

Parts added after the bundle's first version are optional: an older bundle still builds.
"""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta, Struct

from opsd.errors import PermanentError
from opsd.protocol.answers import CheckpointEntry, Mtbf, RunStatus, decode_answer
from opsd.protocol.fields import Finite
from opsd.protocol.flight_analysis import FlightAnalysis
from opsd.protocol.records import Action, IncidentRow


class RunSummary(Struct, frozen=True, kw_only=True):
    """The run: its name, state, when it was created and last changed, its launches and steps."""

    id: Annotated[str, Meta(min_length=1)]
    state: str | None = None
    created_s: Finite | None = None
    updated_s: Finite | None = None
    generation: int | None = None
    last_step: int | None = None
    final_step: int | None = None


class Blocking(Struct, frozen=True, kw_only=True):
    """The checkpoints' blocking seconds, over those whose manifest says."""

    count: int | None = None
    mean_s: Finite | None = None
    max_s: Finite | None = None


class XidMeaning(Struct, frozen=True, kw_only=True):
    """What an XID means and what opsd does about it (``opsd.protocol.xid_table``)."""

    meaning: str | None = None
    action: str | None = None


class LaunchRecord(Struct, frozen=True, kw_only=True):
    """A launch of the run as recorded: its steps, ranks and samples, and its collective seconds by stack
    (``"phase;dimension;op"``, the longest first)."""

    generation: int | None
    started_s: Finite | None = None
    updated_s: Finite | None = None
    first_step: int | None = None
    last_step: int | None = None
    ranks: int | None = None
    samples: int | None = None
    comm: dict[str, Finite] | None = None


class Bundle(Struct, frozen=True, kw_only=True):
    generated_unix_s: Finite  # "now"
    run: RunSummary
    status: RunStatus | None
    incidents: tuple[IncidentRow, ...] | None
    actions: tuple[Action, ...] | None
    checkpoints: tuple[CheckpointEntry, ...] | None
    checkpoint_blocking_s: Blocking | None = None
    flight_recorder: dict[str, FlightAnalysis] | None = None
    xid_table: dict[str, XidMeaning] | None = None
    mtbf: Mtbf | None = None  # older bundles: the status's mtbf_s alone
    launches: tuple[LaunchRecord, ...] | None = None  # absent from older bundles

    def __post_init__(self) -> None:
        for i, action in enumerate(self.actions or ()):  # each result is the struct of its kind
            try:
                action.outcome  # noqa: B018 (decoded for its check)
            except PermanentError as exc:
                raise ValueError(f"{exc} - at `$.actions[{i}]`") from None


def read_bundle(raw: Any) -> Bundle:
    """The bundle from its decoded JSON; PermanentError naming the path of a field that is wrong."""
    return decode_answer(raw, Bundle, "post-mortem bundle")
