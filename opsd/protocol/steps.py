"""The steps of a recovery as data: one struct per kind, a tagged union (``Step``) whose tag is the step's
``ActionKind``. The plan makes them (``opsd.policy.recovery``), the state store keeps each one's fields as the
action's ``args`` (JSON, the kind in its own column), the executor matches them by type
(``opsd.controller.recovery``), and the API and the post-mortem read the same structs back (``step_of``)."""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec
from msgspec import Struct

from opsd.errors import PermanentError
from opsd.protocol.states import ActionKind


class _Step(Struct, frozen=True, kw_only=True, omit_defaults=True, tag_field="kind"):
    kind: ClassVar[ActionKind]


class CheckpointStep(_Step, frozen=True, kw_only=True, tag=ActionKind.CHECKPOINT.value):
    """A graceful restart's: a checkpoint asked of the ranks at ``at_step`` (None: they do not progress), awaited."""

    kind = ActionKind.CHECKPOINT
    at_step: int | None


class DumpStep(_Step, frozen=True, kw_only=True, tag=ActionKind.DUMP.value):
    """A hang's: the ranks' Flight Recorder dumps, kept under ``trigger``, asked for and awaited."""

    kind = ActionKind.DUMP
    trigger: str


class CordonStep(_Step, frozen=True, kw_only=True, tag=ActionKind.CORDON.value):
    """Take ``node`` out of service, for ``reason``."""

    kind = ActionKind.CORDON
    node: str
    reason: str


class TakeSpareStep(_Step, frozen=True, kw_only=True, tag=ActionKind.TAKE_SPARE.value):
    """Promote a spare in place of ``failed`` (``for`` in the record)."""

    kind = ActionKind.TAKE_SPARE
    failed: str = msgspec.field(name="for")


class StopStep(_Step, frozen=True, kw_only=True, tag=ActionKind.STOP.value):
    """Stop the ranks of launch ``generation``: every rank, or those of replica ``group``."""

    kind = ActionKind.STOP
    generation: int
    group: int | None = None


class LaunchStep(_Step, frozen=True, kw_only=True, tag=ActionKind.LAUNCH.value):
    """Launch the ranks again after ``after_generation``: every rank, or those of replica ``group``."""

    kind = ActionKind.LAUNCH
    after_generation: int
    group: int | None = None


Step = CheckpointStep | DumpStep | CordonStep | TakeSpareStep | StopStep | LaunchStep


def step_args(step: Step) -> dict[str, Any]:
    """A step's fields as the action's ``args`` (JSON values; its kind goes in a column of its own)."""
    args: dict[str, Any] = msgspec.to_builtins(step)
    args.pop("kind")
    return args


def step_of(kind: str, args: dict[str, Any]) -> Step:
    """The step an action records (its ``kind`` and ``args``); ``PermanentError`` naming what does not fit."""
    try:
        step: Step = msgspec.convert({**args, "kind": str(kind)}, Step)
    except msgspec.ValidationError as exc:
        raise PermanentError(f"a recorded {kind!r} step does not fit: {exc}") from None
    return step
