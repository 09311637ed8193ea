"""The messages a rank sends to its node agent: version 1 of the wire format (see docs/protocol.md).

One JSON object per step and rank (``kind: "step"``), UTF-8, at most ``MAX_MESSAGE_BYTES``; never one message
per collective. Besides, one ``kind: "collective_timeout"`` message when a rank has waited on a collective for
longer than its timeout, and one ``kind: "activity"`` message when a rank stops stepping for a reason it knows (a
checkpoint it waits for, its end) and when it trains again.
Decoding parses and validates in one pass (msgspec, against ``StepReport``): a few microseconds a datagram.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Final, Literal

import msgspec
from msgspec import Meta, Struct

from opsd.errors import PermanentError
from opsd.protocol.fields import Count, Name, RankId, Seconds

VERSION: Final = 1
MAX_MESSAGE_BYTES = 8192

#: the phases of training a collective is counted under
PHASES = ("forward", "backward", "optimizer", "other")
Phase = Literal["forward", "backward", "optimizer", "other"]


class CommEntry(Struct, frozen=True, array_like=True):
    """A comms entry, on the wire an array: dimension, op, count, bytes, seconds and, optionally, the phase
    (``other`` when absent; elements after it are ignored)."""

    dimension: str
    op: str
    count: Count
    bytes: Count
    seconds: Seconds
    phase: Phase = "other"


class CheckpointReport(Struct, frozen=True):
    """A checkpoint save that finished since the previous report."""

    step: Count
    blocking_s: Seconds  # training was stopped for this long
    total_s: Seconds  # from the start of the save to its commit (async saves finish in the background)
    bytes: Count  # written by this rank
    staging_s: Seconds = 0.0  # the part of blocking_s spent copying the state to host memory (async saves)


MAX_CHECKPOINTS_PER_REPORT = 4
#: a schedule's name on the wire: a plain label (``gpipe``, ``1f1b``, ...)
ScheduleName = Annotated[str, Meta(max_length=64, pattern=r"^[A-Za-z0-9_.-]*$(?!\n)")]


class PipelineReport(Struct, frozen=True):
    """The rank's part in a pipeline: the seconds its training thread waited on the pipeline's sends and receives
    in the step (its bubble), and the schedule it runs, when the trainer said (``""`` and 0: not said)."""

    bubble_s: Seconds
    schedule: ScheduleName = ""
    stages: Count = 0
    microbatches: Count = 0


class FtReport(Struct, frozen=True):
    """A rank of a fault-tolerant replica group (torchft): the quorum of its step. ``replica_groups`` is what the
    job was laid out for, ``quorum_replicas`` the groups in the step's quorum, ``participants`` those of them that
    trained (a healing group does not); ``committed`` is false when the step's update was discarded (the same
    batch is trained again); ``healing_s`` the seconds the step spent fetching and loading a peer's state,
    ``quorum_wait_s`` those the training thread waited for the quorum."""

    replica_group: Count
    replica_groups: Count
    quorum_id: Count
    quorum_replicas: Count
    participants: Count
    committed: bool = True
    healing_s: Seconds = 0.0
    quorum_wait_s: Seconds = 0.0


class StepReport(Struct, frozen=True, omit_defaults=True):
    """Version 1 of the step report; every field without a default is required, unknown fields are ignored. The
    monitor builds it; an optional field at its default is left out on the wire."""

    v: Literal[1]
    kind: Literal["step"]
    run: str
    rank: Count
    world_size: Count
    host: str
    step: Count
    time_unix_s: float
    step_s: Seconds
    compute_s: float
    exposed_comm_s: Seconds
    overlapped_comm_s: Seconds
    tokens: Count
    tokens_per_s: Seconds
    job_tokens_per_s: Seconds
    mfu_ratio: Seconds
    memory: dict[str, Count]
    coords: dict[str, Count]
    comms: list[CommEntry]
    dropped_reports_total: Count
    internal_errors_total: Count
    truncated: bool = False
    checkpoints: Annotated[list[CheckpointReport], Meta(max_length=MAX_CHECKPOINTS_PER_REPORT)] = []
    loss: float | None = None  # the step's training loss, when the trainer reported it
    resumed_from_step: Count | None = None  # the checkpoint this launch of the rank resumed from, if any
    pipeline: PipelineReport | None = None  # ranks of a pipeline stage: the step's bubble and the schedule
    launch: Count | None = None  # the launch of the run this rank belongs to ($OPSD_LAUNCH), when the backend says
    ft: FtReport | None = None  # a rank of a fault-tolerant replica group: the step's quorum
    # process groups whose collectives are timed on the host because their GPU completion hook was refused
    comm_timing_fallbacks_total: Count = 0
    # of the seconds of ``comms``, those timed on the host (from the call's launch) on such groups
    comm_host_timed_s: Seconds = 0.0
    # checkpoint saves skipped because the previous one was still being written
    checkpoints_skipped_total: Count = 0


def pipeline_bubble_ratio(report: StepReport) -> float | None:
    """The rank's bubble in its last step as a fraction of the step (0-1); None when it reported no pipeline."""
    if report.pipeline is None:
        return None
    if report.step_s <= 0:
        return 0.0
    return min(report.pipeline.bubble_s / report.step_s, 1.0)


class CollectiveWait(Struct, frozen=True, kw_only=True):
    """A rank that has waited on one collective for longer than its timeout: the rank says so (``TimeoutReport``),
    and its agent sends it on in each heartbeat with the ranks until the rank steps on."""

    run: Name
    rank: RankId
    step: Count  # steps completed before the wait
    time_unix_s: float
    dim: Annotated[str, Meta(max_length=64)]  # the mesh dimension of the collective's group
    op: Annotated[str, Meta(max_length=64)]
    waited_s: Seconds


class TimeoutReport(CollectiveWait, frozen=True, kw_only=True):
    """The rank's message of a ``CollectiveWait`` (sent once per wait)."""

    v: Literal[1]
    kind: Literal["collective_timeout"]
    host: str

    def wait(self) -> CollectiveWait:
        """What its agent sends on."""
        return CollectiveWait(**{name: getattr(self, name) for name in CollectiveWait.__struct_fields__})


#: what a rank does when it does not step for a reason it knows ("": it trains again)
Activity = Literal["", "checkpoint", "closing"]
CHECKPOINT: Activity = "checkpoint"
CLOSING: Activity = "closing"


class ActivityReport(Struct, frozen=True, kw_only=True):
    """A rank that stops stepping for a reason it knows says so (``checkpoint``: a save it waits for; ``closing``:
    its training loop is over, it ends), and says again when it trains again (``""``); a step report ends it too.
    The controller judges no hang of ranks that say it, for at most ``detection.busy_limit_s``."""

    v: Literal[1]
    kind: Literal["activity"]
    run: Name
    rank: RankId
    host: str
    time_unix_s: float
    activity: Activity


class _Kind(Struct):
    kind: str


#: the required fields
OPTIONAL_FIELDS = (
    "truncated",
    "checkpoints",
    "loss",
    "resumed_from_step",
    "pipeline",
    "launch",
    "ft",
    "comm_timing_fallbacks_total",
    "comm_host_timed_s",
    "checkpoints_skipped_total",
)
STEP_FIELDS = tuple(f for f in StepReport.__struct_fields__ if f not in OPTIONAL_FIELDS)

#: the values of ``WireError.reason``
REASONS = ("too_large", "not_json", "not_object", "version", "field", "kind", "comms")

_DECODER = msgspec.json.Decoder(StepReport)
_OTHER_DECODERS: dict[str, msgspec.json.Decoder[Any]] = {
    "collective_timeout": msgspec.json.Decoder(TimeoutReport),
    "activity": msgspec.json.Decoder(ActivityReport),
}
_KIND_DECODER = msgspec.json.Decoder(_Kind)


class WireError(PermanentError, ValueError):
    """A message that does not follow the wire format; the text says which rule it breaks, ``reason`` names the
    rule in a few words fit for a metric label (one of ``REASONS``)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def encode(report: StepReport | TimeoutReport | ActivityReport | dict[str, Any]) -> bytes:
    """Serialise a report (or a message as a dict, as tests write them). Rather than exceed the bound it drops the
    comms' phases (entries merged per dimension and op), then the comms detail, flagging ``truncated``; a value
    that is not a finite number raises ``ValueError``."""
    message: dict[str, Any] = msgspec.to_builtins(report) if isinstance(report, Struct) else report
    data = json.dumps(message, separators=(",", ":"), allow_nan=False).encode()
    if len(data) > MAX_MESSAGE_BYTES and message.get("comms"):
        merged: dict[tuple[str, str], list[Any]] = {}
        for dim, op, count, nbytes, seconds, *_ in message["comms"]:
            entry = merged.setdefault((dim, op), [dim, op, 0, 0, 0.0])
            entry[2] += count
            entry[3] += nbytes
            entry[4] += seconds
        merged_message = {**message, "comms": list(merged.values()), "truncated": True}
        data = json.dumps(merged_message, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE_BYTES:
        data = json.dumps({**message, "comms": [], "truncated": True}, separators=(",", ":")).encode()
    return data


def _reason(error: msgspec.ValidationError) -> str:
    text = str(error)
    if "`$.v`" in text or "field `v`" in text:
        return "version"
    if "`$.kind`" in text or "field `kind`" in text:
        return "kind"
    if "`$.comms" in text:
        return "comms"
    if text.startswith("Expected `object`") and "- at" not in text:
        return "not_object"
    return "field"


def decode_report(data: bytes) -> StepReport | TimeoutReport | ActivityReport:
    """Parse and validate one datagram; raises :class:`WireError` naming the broken rule."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}", "too_large")
    try:
        return _DECODER.decode(data)
    except msgspec.ValidationError as exc:
        reason = _reason(exc)
        if reason == "kind" and "`$.kind`" in str(exc):  # a kind, not "step": a timeout or an activity, or neither
            other = _other_decoder(data)
            if other is not None:
                try:
                    report: TimeoutReport | ActivityReport = other.decode(data)
                except msgspec.ValidationError as broken:
                    raise WireError(str(broken), _reason(broken)) from None
                return report
        if reason == "version":
            raise WireError(f"unsupported version ({exc}; this side speaks {VERSION})", reason) from None
        raise WireError(str(exc), reason) from None
    except msgspec.DecodeError as exc:
        raise WireError(f"not JSON: {exc}", "not_json") from None


def _other_decoder(data: bytes) -> msgspec.json.Decoder[Any] | None:
    """The decoder of a message whose kind is not ``step`` (None: a kind this side does not know)."""
    try:
        return _OTHER_DECODERS.get(_KIND_DECODER.decode(data).kind)
    except msgspec.ValidationError:
        return None


def decode(data: bytes) -> dict[str, Any]:
    """Validate like :func:`decode_report`, return the message as it was sent (a dict, unknown fields kept)."""
    decode_report(data)
    message: dict[str, Any] = json.loads(data)
    return message
