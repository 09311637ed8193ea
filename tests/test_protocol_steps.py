"""The recovery steps as recorded: each kind's struct and the ``args`` the state store keeps for it (the records of
earlier versions included), and what does not make a step."""

from __future__ import annotations

from typing import Any

import pytest

from opsd.errors import PermanentError
from opsd.protocol.answers import decode_answer
from opsd.protocol.records import Action
from opsd.protocol.states import ActionKind
from opsd.protocol.steps import (
    CheckpointStep,
    Cordoned,
    CordonStep,
    DumpStep,
    LaunchStep,
    Step,
    StopStep,
    TakeSpareStep,
    step_args,
    step_of,
)

RECORDS: dict[str, tuple[Step, dict[str, Any]]] = {
    "a graceful restart's checkpoint": (CheckpointStep(at_step=120), {"at_step": 120}),
    "a checkpoint skipped (the ranks did not progress): said, not left out": (
        CheckpointStep(at_step=None),
        {"at_step": None},
    ),
    "a hang's dumps": (DumpStep(trigger="incident-7"), {"trigger": "incident-7"}),
    "a cordon": (CordonStep(node="n1", reason="XID 79"), {"node": "n1", "reason": "XID 79"}),
    "a spare for a node, 'for' in the record": (TakeSpareStep(failed="n1"), {"for": "n1"}),
    "the whole job stopped": (StopStep(generation=3), {"generation": 3}),
    "a replica group stopped": (StopStep(generation=3, group=1), {"generation": 3, "group": 1}),
    "the whole job launched": (LaunchStep(after_generation=3), {"after_generation": 3}),
    "a replica group launched": (LaunchStep(after_generation=3, group=0), {"after_generation": 3, "group": 0}),
}


@pytest.mark.parametrize(("step", "args"), RECORDS.values(), ids=RECORDS.keys())
def test_a_step_is_recorded_as_its_fields_and_read_back_whole(step: Step, args: dict[str, Any]) -> None:
    assert step_args(step) == args
    assert step_of(step.kind, args) == step
    assert step_of(step.kind.value, {**args, "added_by_a_newer_version": 1}) == step


@pytest.mark.parametrize(
    ("kind", "args", "named"),
    [
        ("launch", {}, "after_generation"),
        ("stop", {"generation": "3"}, "$.generation"),
        ("take_spare", {"node": "n1"}, "for"),
        ("reboot", {}, "$.kind"),
    ],
)
def test_a_record_that_makes_no_step_is_a_clear_error(kind: str, args: dict[str, Any], named: str) -> None:
    with pytest.raises(PermanentError, match=named.replace("$", r"\$")):
        step_of(kind, args)


def test_the_post_mortem_reads_the_same_steps_and_refuses_what_does_not_fit() -> None:
    assert {s.kind for s, _ in RECORDS.values()} == set(ActionKind)
    action = {"request_id": "r", "incident_id": 1, "run": "job", "seq": 0, "kind": "cordon", "state": "done"}
    action |= {"args": {"node": "n1", "reason": "r"}, "created_s": 1.0, "done_s": 2.0, "result": {"node": "n1"}}
    (read,) = decode_answer([action], tuple[Action, ...], "actions")
    assert (read.step, read.outcome) == (CordonStep(node="n1", reason="r"), Cordoned(node="n1"))
    with pytest.raises(PermanentError, match=r"Invalid enum value 'reboot' - at `\$\[0\].kind`"):
        decode_answer([{**action, "kind": "reboot"}], tuple[Action, ...], "actions")
