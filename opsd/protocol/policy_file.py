"""The policy: what the controller asks of a run's ranks (docs/protocol.md, "Policy"). One struct, built by the
controller, carried in the heartbeat's reply (``opsd.protocol.heartbeat.HeartbeatReply.policy``), written by the
node agent to the policy file (``$OPSD_POLICY_FILE``) and served at ``GET /v1/policy``, and read by the ranks
(``trainer_hooks.policy_reader``); every one of them encodes and decodes it with this module.

The checkpoint cadence is "every K steps from step E": E is chosen by the controller safely in the future, so
every rank, whichever moment its node's file changed, saves at the same steps (a checkpoint is a collective).
Before E, what was in force before applies: the ``previous`` cadence the policy names, else the rank's local one
(the same on every rank, since every rank got the same command line). Commands (``dump_flight_recorder``) run once
per id on the ranks they name. In a fault-tolerant run, ``failed_groups`` names the replica groups opsd found
failed and is recovering: the other groups' ranks abort a cross-group collective with one of them at once, rather
than wait for their timeout (``trainer_hooks.integrations.torchft``).

The policy always says its version (``"v": 1``, a tag msgspec writes and checks); one without it (a controller
before the tag) is read as version 1. Fields left at their default are not written.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta, Struct

from opsd.errors import PermanentError

VERSION = 1
#: the command that asks ranks for a Flight Recorder dump (docs/flight-recorder.md)
DUMP_COMMAND = "dump_flight_recorder"

Steps = Annotated[int, Meta(ge=1)]
Step = Annotated[int, Meta(ge=0)]
RankId = Annotated[int, Meta(ge=0)]
GroupId = Annotated[int, Meta(ge=0)]
IncidentId = Annotated[int, Meta(ge=0)]


class PolicyError(PermanentError, ValueError):
    """A policy that does not follow docs/protocol.md."""


class Cadence(Struct, frozen=True, kw_only=True):
    """Save at every step ``s >= from_step`` with ``(s - from_step) % every_steps == 0``."""

    every_steps: Steps
    from_step: Step = 0

    def due(self, step: int) -> bool | None:
        """Whether ``step`` is one of the cadence's; None before ``from_step`` (another rule decides)."""
        if step < self.from_step:
            return None
        return (step - self.from_step) % self.every_steps == 0


class CheckpointCadence(Cadence, frozen=True, kw_only=True):
    """The cadence in force from ``from_step``, and the one in force before it (``previous``; None: the rank's
    local cadence)."""

    previous: Cadence | None = None


class Command(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A command for the ranks, run once per ``id`` by each rank named (``ranks``; None: every rank)."""

    id: str
    name: str  # e.g. "dump_flight_recorder"
    ranks: tuple[RankId, ...] | None = None


class FailedGroup(Struct, frozen=True, kw_only=True):
    """Replica group ``group`` failed (incident ``incident``, recovered in that group alone): the other groups abort
    a collective they wait on with it. Named from the start of the recovery until the group is back in the quorum."""

    group: GroupId
    incident: IncidentId


class Policy(Struct, frozen=True, kw_only=True, omit_defaults=True, tag_field="v", tag=VERSION):
    """The policy for a run's ranks; ``Policy()`` says nothing (the ranks keep their local cadence)."""

    checkpoint: CheckpointCadence | None = None
    checkpoint_at_step: Steps | None = None  # a one-off checkpoint asked for (a graceful restart), besides the cadence
    commands: tuple[Command, ...] | None = None  # None: the run never had one (an empty tuple: it had, now none)
    failed_groups: tuple[FailedGroup, ...] | None = None  # None: none ever was (an empty tuple: none is now)

    @property
    def empty(self) -> bool:
        return self == EMPTY

    def checkpoint_due(self, step: int, local: bool = False) -> bool:
        """Whether to save after ``step``; ``local``: the rank's own cadence's answer, used before any published
        cadence takes effect."""
        if step == self.checkpoint_at_step:
            return True
        c = self.checkpoint
        if c is None:
            return local
        for rule in (c, c.previous):
            due = rule.due(step) if rule is not None else None
            if due is not None:
                return due
        return local


EMPTY = Policy()
_DECODER = msgspec.json.Decoder(Policy)
_ENCODER = msgspec.json.Encoder()


def decode_policy(data: bytes | str) -> Policy:
    """Parse and validate a policy (the file, the agent's answer); ``PolicyError`` names what does not fit."""
    try:
        return _DECODER.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise PolicyError(f"policy does not fit docs/protocol.md: {exc}") from None


def encode_policy(policy: Policy) -> bytes:
    return _ENCODER.encode(policy)
