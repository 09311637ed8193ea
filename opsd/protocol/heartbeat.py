"""The heartbeat: what a node agent sends the controller about every second, and the controller's reply
(docs/protocol.md, "Heartbeat"). One schema, used by the agent to build it, by the controller to decode and handle
it, and by the scale benchmark to simulate thousands of agents.

Decoding parses and validates in one pass (msgspec): a body that does not fit raises ``BodyError`` whose text
names the field (``$.ranks[3].step``). Constraints (``Meta``) are checked on decoding only: a sender builds the
structs without them, the receiver refuses what breaks them.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct

from opsd.errors import BodyError
from opsd.protocol.fields import Count, Label, Name, NonNegative, RankId, SpanId, TraceId
from opsd.protocol.policy_file import Policy
from opsd.protocol.wire import CollectiveWait

VERSION: Literal[1] = 1
PATH = "/v1/heartbeat"
#: the heartbeat process's answer to a heartbeat only the API answers (its node or a run of it new, GPU events):
#: send it to the API's URL (421 Misdirected Request)
SEND_TO_API = 421
T = TypeVar("T")


class HeartbeatPipeline(Struct, kw_only=True):
    """A pipeline stage's last step: the fraction of it spent waiting on the neighbour stages (its bubble), and the
    schedule the rank runs (``""`` and 0 when its trainer did not say)."""

    bubble_ratio: Annotated[float, Meta(ge=0, le=1)]
    schedule: Annotated[str, Meta(max_length=64)] = ""
    stages: Count = 0
    microbatches: Count = 0


class HeartbeatFt(Struct, kw_only=True):
    """A rank of a fault-tolerant replica group: the quorum of its last step, and the agent's running sums of its
    reports (heals and their seconds, seconds waiting for a quorum, steps whose update was discarded)."""

    replica_group: Count
    replica_groups: Count
    quorum_id: Count
    quorum_replicas: Count  # replica groups in the last step's quorum
    participants: Count  # of which trained in it (a healing group does not)
    committed: bool = True  # the last step's update was applied
    heals: Count = 0
    healing_total_s: NonNegative = 0.0
    quorum_wait_total_s: NonNegative = 0.0
    discarded_steps: Count = 0


class HeartbeatRank(Struct, kw_only=True):
    """A rank the agent heard from: its last step and the agent's running sums of its reports."""

    run: Name
    rank: RankId
    host: str = ""
    step: Count
    step_s: NonNegative
    compute_s: NonNegative = 0.0
    steps_total: Count = 0  # steps reported so far
    compute_total_s: NonNegative = 0.0  # and their compute seconds, summed
    mfu_ratio: NonNegative = 0.0
    job_tokens_per_s: NonNegative = 0.0
    checkpoints: Count = 0  # saves so far
    checkpoint_blocking_s: NonNegative = 0.0  # and the seconds they blocked training, summed
    checkpoint_total_s: NonNegative = 0.0  # and the seconds from their start to their commit, summed
    last_report_unix_s: float = 0.0
    coords: dict[str, Count] = {}
    resumed_from_step: Count | None = None  # the checkpoint the rank's launch resumed from (its step reports say)
    pipeline: HeartbeatPipeline | None = None  # a pipeline stage's bubble and schedule (its step reports say)
    launch: Count | None = None  # the launch of the run the rank belongs to, when its step reports say
    ft: HeartbeatFt | None = None  # a rank of a fault-tolerant replica group: its quorum (its step reports say)
    world_size: Count = 0  # the job's ranks, as the rank's step reports say (0: not said)
    # what the rank said it does instead of stepping (``opsd.protocol.wire.ActivityReport``; "": it steps), and for
    # how long it has, by the agent's clock
    activity: Annotated[str, Meta(max_length=64)] = ""
    activity_s: NonNegative = 0.0


class HeartbeatEvent(Struct, kw_only=True, frozen=True):
    """A GPU health event the controller has not acknowledged yet (resent until it is)."""

    seq: Count
    gpu: Count
    xid: int
    time_s: float
    # an ``XidAction``'s value, or ``xid_table.COUNTED`` (a str: a newer agent's action must not refuse it)
    action: Annotated[str, Meta(max_length=64)]
    reason: Annotated[str, Meta(max_length=1000)] = ""
    trace_id: TraceId = ""  # the agent's OpenTelemetry span of the event, when it exports spans
    span_id: SpanId = ""


#: a run's collective totals on the node, cumulative: run, phase, dimension, op, seconds, count, bytes (names are
#: checked for length alone here, where every microsecond counts: the flame graph escapes what it writes)
CommRow = tuple[Annotated[str, Meta(min_length=1, max_length=200)], Label, Label, Label, NonNegative, Count, Count]


class NodeSummary(Struct, kw_only=True, frozen=True):
    """The node's ranks at one moment, as the agent summed them up: how many, their slowest and mean step time, and
    their mean MFU (0 where none reported)."""

    time_unix_s: float = 0.0
    ranks: Count = 0
    step_s_max: NonNegative = 0.0
    step_s_mean: NonNegative = 0.0
    mfu_ratio_mean: NonNegative = 0.0


class Heartbeat(Struct, kw_only=True):
    """An agent's heartbeat (docs/protocol.md); unknown fields are ignored."""

    v: Literal[1]
    node: Name
    time_unix_s: float
    ranks: Annotated[list[HeartbeatRank], Meta(max_length=4096)] = []
    events: Annotated[list[HeartbeatEvent], Meta(max_length=10_000)] = []
    summaries: Annotated[list[NodeSummary], Meta(max_length=10_000)] = []
    summaries_dropped_total: Count = 0
    timeouts: Annotated[list[CollectiveWait], Meta(max_length=4096)] = []
    comms: Annotated[list[CommRow], Meta(max_length=4096)] = []


class HeartbeatReply(Struct, kw_only=True):
    """The controller's answer: GPU events handled up to ``ack_events_up_to``, the policy for the node's ranks
    (docs/protocol.md, "Policy") when it has one, how often to send the ranks, where liveness datagrams go
    (``opsd.protocol.liveness``; None: send liveness over HTTP), and the port of the controller's host whose process
    answers heartbeats (same scheme, path and token as the API; None: send them to the API). A controller older
    than the last two says neither interval nor port: its agents send everything every interval."""

    ack_events_up_to: int
    policy: Policy | None = None
    telemetry_interval_s: Annotated[float, Meta(gt=0)] | None = None
    liveness_port: Annotated[int, Meta(ge=1, le=65535)] | None = None
    heartbeat_port: Annotated[int, Meta(ge=1, le=65535)] | None = None


_DECODER = msgspec.json.Decoder(Heartbeat)
_REPLY_DECODER = msgspec.json.Decoder(HeartbeatReply)
_ENCODER = msgspec.json.Encoder()


def decode_heartbeat(data: bytes) -> Heartbeat:
    """Parse and validate a heartbeat body (defaults filled in); ``BodyError`` names what does not fit."""
    return _decode(_DECODER, data)


def decode_reply(data: bytes) -> HeartbeatReply:
    """Parse and validate the controller's reply (the agent's side); ``BodyError`` names what does not fit."""
    return _decode(_REPLY_DECODER, data)


def _decode(decoder: msgspec.json.Decoder[T], data: bytes) -> T:
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise BodyError(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise BodyError(f"not JSON: {exc}") from None


def encode(message: Heartbeat | HeartbeatReply) -> bytes:
    """The JSON bytes of a heartbeat or a reply."""
    return _ENCODER.encode(message)


def json_schemas(ref_template: str) -> tuple[dict[str, object], dict[str, object], dict[str, object]]:
    """(request schema, reply schema, their components) for an API document."""
    (request, reply), components = msgspec.json.schema_components(
        [Heartbeat, HeartbeatReply], ref_template=ref_template
    )
    return request, reply, components
