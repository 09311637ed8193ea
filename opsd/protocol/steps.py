"""The steps of a recovery as data: one struct per kind, a tagged union (``Step``) whose tag is the step's
``ActionKind``. The plan makes them (``opsd.policy.recovery``), the state store keeps each one's fields as the
action's ``args`` (JSON, the kind in its own column), the executor matches them by type
(``opsd.controller.recovery``), and the API and the post-mortem read the same structs back (``step_of``)."""

from __future__ import annotations

from typing import ClassVar

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


def step_args(step: Step) -> dict[str, object]:
    """A step's fields as the action's ``args`` (JSON values; its kind goes in a column of its own)."""
    args: dict[str, object] = msgspec.to_builtins(step)
    args.pop("kind")
    return args


def step_of(kind: str, args: dict[str, object]) -> Step:
    """The step an action records (its ``kind`` and ``args``); ``PermanentError`` naming what does not fit."""
    try:
        step: Step = msgspec.convert({**args, "kind": str(kind)}, Step)
    except msgspec.ValidationError as exc:
        raise PermanentError(f"a recorded '{kind}' step does not fit: {exc}") from None
    return step


# -- what each step did: a backend's answer (``Done.data``), and what the action's record keeps ---------------------
class _Result(Struct, frozen=True, kw_only=True, omit_defaults=True):
    pass


class Stopped(_Result, frozen=True, kw_only=True):
    """``stop_ranks``: the ranks it stopped that still ran, and the launch stopped where the backend numbers its
    launches (``launch``; ``launches``: one per replica group where it launches them apart)."""

    killed: int = 0
    launch: int | None = None
    launches: list[int] | None = None
    restart_attempt: int | None = None  # a JobSet's restart count then


class NodeChanged(_Result, frozen=True, kw_only=True):
    """``quarantine_node``, ``release_node``, ``promote_spare``: whether the node changed (None: not said)."""

    changed: bool | None = None


class Unusable(_Result, frozen=True, kw_only=True):
    """A checkpoint newer than the one resumed from, and why it could not be."""

    step: int
    problem: str | None = None


class Launched(_Result, frozen=True, kw_only=True):
    """``relaunch``: where the ranks run and which launch they are (``launch``, or ``launches`` and
    ``group_nodes`` per replica group), what they resumed from and the newer checkpoints skipped; the controller
    adds the generation and the replica group it launched."""

    launch: int | None = None
    launches: list[int] | None = None
    nodes: list[str] | None = None
    group_nodes: list[list[str]] | None = None
    pods: int | None = None
    restart_attempt: int | None = None
    resumed_from_step: int | None = None
    skipped: list[Unusable] | None = None
    generation: int | None = None
    group: int | None = None


class DumpReady(_Result, frozen=True, kw_only=True):
    """``request_dump``: the ranks still running, who can dump (None: the controller's view of them decides)."""

    ranks: list[int] | None = None


class Injected(_Result, frozen=True, kw_only=True):
    """``inject``: what was done, in words."""

    injected: str = ""


class CheckpointTaken(_Result, frozen=True, kw_only=True):
    """A ``checkpoint`` step: the step committed (None: none, and ``why``), the one asked for, the wait."""

    checkpoint_step: int | None
    asked_step: int | None = None
    waited_s: float | None = None
    why: str | None = None


class Blame(_Result, frozen=True, kw_only=True):
    rank: int | None = None
    node: str | None = None


class Culprit(Blame, frozen=True, kw_only=True):
    """The rank a hang's dumps name, and the detection's first guess when they name another."""

    first_blamed: Blame | None = None


class Swap(_Result, frozen=True, kw_only=True):
    """A node to swap although the failure alone did not call for it, and why."""

    node: str
    reason: str


class Dumped(_Result, frozen=True, kw_only=True):
    """A ``dump`` step: the dumps awaited and received, and what they blame (``culprit``; ``quarantine``: a node
    blamed ``strikes`` times, to be swapped)."""

    trigger: str
    ranks_expected: list[int]
    ranks_dumped: list[int]
    waited_s: float
    culprit: Culprit | None = None
    strikes: int | None = None
    quarantine: Swap | None = None


class Cordoned(NodeChanged, frozen=True, kw_only=True):
    node: str = ""


class SpareTaken(_Result, frozen=True, kw_only=True):
    """A ``take_spare`` step: the spare taken, or none and the node count the run went on with."""

    spare: str | None = None
    shrunk_to_nodes: int | None = None


Result = CheckpointTaken | Dumped | Cordoned | SpareTaken | Stopped | Launched
RESULTS: dict[ActionKind, type[Result]] = {
    ActionKind.CHECKPOINT: CheckpointTaken,
    ActionKind.DUMP: Dumped,
    ActionKind.CORDON: Cordoned,
    ActionKind.TAKE_SPARE: SpareTaken,
    ActionKind.STOP: Stopped,
    ActionKind.LAUNCH: Launched,
}


def result_record(result: _Result) -> dict[str, object]:
    """A result as the action's record keeps it (JSON values)."""
    record: dict[str, object] = msgspec.to_builtins(result)
    return record


def result_of(kind: str, record: dict[str, object]) -> Result:
    """The result an action of ``kind`` recorded; ``PermanentError`` naming what does not fit."""
    try:
        result: Result = msgspec.convert(record, RESULTS[ActionKind(kind)])
    except (msgspec.ValidationError, ValueError) as exc:
        raise PermanentError(f"a recorded '{kind}' result does not fit: {exc}") from None
    return result
