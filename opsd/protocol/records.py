"""The controller's records the API answers as they are kept: a node, an incident, a recovery's action (the
state store's rows, ``opsd.controller.state``). The CLI and the post-mortem decode them with these types too
(msgspec checks the fields on decoding: ``opsd.protocol.answers.decode_answer``); the controller builds them
without checks, from what it wrote.

Frozen: a record is what the store held when it was read.
"""

from __future__ import annotations

from dataclasses import dataclass

from opsd.protocol.fields import Finite, JsonObject
from opsd.protocol.states import ActionKind, ActionState, IncidentKind, IncidentState, NodeRole
from opsd.protocol.steps import Result, Step, result_of, step_of


@dataclass(frozen=True, slots=True)
class NodeRow:
    name: str
    run: str | None  # the run it serves (active or spare), or None (a shared spare, or no run's)
    role: NodeRole
    domain: str
    reason: str  # why it was cordoned
    events_acked: int  # GPU events handled, up to this seq
    updated_s: Finite


@dataclass(frozen=True, slots=True)
class IncidentRow:
    id: int
    key: str  # unique: the same failure reported again finds it (``opsd.controller.incidents``)
    run: str
    kind: IncidentKind
    node: str
    rank: int | None
    detail: str
    state: IncidentState
    failed_s: Finite
    detected_s: Finite
    resumed_s: Finite | None = None
    resumed_from_step: int | None = None
    lost_steps: int | None = None
    spare: str | None = None
    trace_id: str | None = None  # its OpenTelemetry trace (W3C hex), when the controller exports traces
    gpu_trace_id: str | None = None  # the agent's span of the GPU event that caused it, which the trace links to
    gpu_span_id: str | None = None
    replica_group: int | None = None  # a replica recovery's group (the others trained on); None: the whole job
    missed_steps: int | None = None  # a replica recovery's: the steps the other groups made while the group was out
    stall_s: Finite | None = None  # a replica recovery's: the longest the other groups waited for a quorum meanwhile


@dataclass(frozen=True, slots=True)
class Action:
    """A step of a recovery, recorded before it is carried out (``opsd.controller.recovery``)."""

    request_id: str
    incident_id: int | None
    run: str
    seq: int
    kind: ActionKind
    args: JsonObject
    state: ActionState
    created_s: Finite
    done_s: Finite | None
    result: JsonObject | None = None

    @property
    def step(self) -> Step:
        """The step its ``kind`` and ``args`` record; ``PermanentError`` when they do not make one."""
        return step_of(self.kind, self.args)

    @property
    def outcome(self) -> Result | None:
        """What it did, as its ``result`` records (None: not done); ``PermanentError`` when that does not fit."""
        return result_of(self.kind, self.result) if self.result is not None else None
