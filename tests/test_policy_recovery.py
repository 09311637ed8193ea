"""The recovery plan: which steps each failure needs, in order, as tables of named cases."""

from __future__ import annotations

from typing import Any

import pytest

from opsd.policy.detection import Failure, FailureKind
from opsd.policy.recovery import (
    OnNoSpare,
    Quarantine,
    fails_at_start,
    hang_strikes,
    plan_recovery,
    quarantine_after_hangs,
    request_id,
    shrinks_without_spare,
)
from opsd.protocol.states import ActionKind
from opsd.protocol.steps import step_args

Steps = list[tuple[str, dict[str, Any]]]
SWAP: Steps = [("cordon", {"node": "n1", "reason": "why"}), ("take_spare", {"for": "n1"}), ("stop", {"generation": 3})]
RELAUNCH: Steps = [("stop", {"generation": 3}), ("launch", {"after_generation": 3})]

PLANS: dict[str, tuple[FailureKind, int | None, Steps]] = {
    # name: (failure, checkpoint step asked, steps)
    "a lost node is swapped": (FailureKind.HEARTBEAT_LOSS, None, [*SWAP, ("launch", {"after_generation": 3})]),
    "a fatal XID is swapped": (FailureKind.FATAL_XID, None, [*SWAP, ("launch", {"after_generation": 3})]),
    "an application XID relaunches in place": (FailureKind.APPLICATION_XID, None, RELAUNCH),
    "a rank that exited relaunches in place": (FailureKind.PROCESS_EXIT, None, RELAUNCH),
    "a hang dumps first": (FailureKind.HANG, None, [("dump", {"trigger": "incident-7"}), *RELAUNCH]),
    "a collective timeout dumps first": (
        FailureKind.COLLECTIVE_TIMEOUT,
        None,
        [("dump", {"trigger": "incident-7"}), *RELAUNCH],
    ),
    "a controller restart relaunches": (FailureKind.CONTROLLER_RESTART, None, RELAUNCH),
    "a graceful restart checkpoints first": (
        FailureKind.MANUAL_RESTART,
        120,
        [("checkpoint", {"at_step": 120}), *RELAUNCH],
    ),
    "a graceful restart of ranks that do not progress": (
        FailureKind.MANUAL_RESTART,
        None,
        [("checkpoint", {"at_step": None}), *RELAUNCH],
    ),
}


@pytest.mark.parametrize(("kind", "at_step", "steps"), PLANS.values(), ids=PLANS.keys())
def test_plan(kind: FailureKind, at_step: int | None, steps: list[tuple[str, dict[str, Any]]]) -> None:
    failure = Failure(kind, "n1", None, "why")
    plan = plan_recovery(failure, incident_id=7, generation=3, checkpoint_at_step=at_step)
    assert [(s.kind, step_args(s)) for s in plan] == steps
    assert all(isinstance(s.kind, ActionKind) for s in plan)


def test_a_plan_is_the_same_every_time_it_is_made() -> None:
    """After a controller restart the plan is made again: the same steps, so the same request ids."""
    failure = Failure(FailureKind.FATAL_XID, "n1", None, "why")
    first = plan_recovery(failure, incident_id=7, generation=3, checkpoint_at_step=None)
    again = plan_recovery(failure, incident_id=7, generation=3, checkpoint_at_step=None)
    ids = [request_id(7, seq, s.kind) for seq, s in enumerate(first)]
    assert ids == [request_id(7, seq, s.kind) for seq, s in enumerate(again)]
    assert ids == ["incident-7-0-cordon", "incident-7-1-take_spare", "incident-7-2-stop", "incident-7-3-launch"]


NO_SPARE = {
    # name: (on no spare, nodes left, min nodes, shrinks)
    "wait is the default": (OnNoSpare.WAIT, 3, 1, False),
    "shrink with nodes to spare": (OnNoSpare.SHRINK, 3, 2, True),
    "shrink down to the minimum": (OnNoSpare.SHRINK, 2, 2, True),
    "below the minimum: wait": (OnNoSpare.SHRINK, 1, 2, False),
}


@pytest.mark.parametrize(("on_no_spare", "left", "minimum", "shrinks"), NO_SPARE.values(), ids=NO_SPARE.keys())
def test_without_a_spare(on_no_spare: OnNoSpare, left: int, minimum: int, shrinks: bool) -> None:
    assert shrinks_without_spare(on_no_spare, left, minimum) is shrinks


SWAP_BLAMED: Steps = [("cordon", {"node": "n0", "reason": "hung twice"}), ("take_spare", {"for": "n0"})]
QUARANTINES: dict[str, tuple[FailureKind, Steps]] = {
    # name: (failure, steps), the plan made again with Quarantine("n0", "hung twice")
    "a hang blamed on a node again swaps it after the dump": (
        FailureKind.HANG,
        [("dump", {"trigger": "incident-7"}), *SWAP_BLAMED, *RELAUNCH],
    ),
    "a fatal XID swaps its own node, not another": (
        FailureKind.FATAL_XID,
        [*SWAP, ("launch", {"after_generation": 3})],
    ),
}


@pytest.mark.parametrize(("kind", "steps"), QUARANTINES.values(), ids=QUARANTINES.keys())
def test_plan_with_a_node_to_quarantine(kind: FailureKind, steps: Steps) -> None:
    failure = Failure(kind, "n1", None, "why")
    quarantine = Quarantine("n0", "hung twice")
    plan = plan_recovery(failure, incident_id=7, generation=3, checkpoint_at_step=None, quarantine=quarantine)
    assert [(s.kind, step_args(s)) for s in plan] == steps


HOUR = 3600.0
STRIKES: dict[str, tuple[list[tuple[str, float]], int, int, bool]] = {
    # name: (hangs blamed (node, detected), strikes of n0 at t=10 h, threshold, quarantined)
    "a first hang is a warning": ([("n0", 10 * HOUR)], 1, 2, False),
    "a second within the window swaps": ([("n0", 1 * HOUR), ("n0", 10 * HOUR)], 2, 2, True),
    "one outside the window does not count": ([("n0", -20 * HOUR), ("n0", 10 * HOUR)], 1, 2, False),
    "another node's hangs do not count": ([("n1", 5 * HOUR), ("n0", 10 * HOUR)], 1, 2, False),
    "a threshold of 0 never swaps": ([("n0", h * HOUR) for h in range(5)], 5, 0, False),
    "a threshold of 1 swaps at the first": ([("n0", 10 * HOUR)], 1, 1, True),
}


@pytest.mark.parametrize(("hangs", "strikes", "threshold", "swapped"), STRIKES.values(), ids=STRIKES.keys())
def test_hang_strikes(hangs: list[tuple[str, float]], strikes: int, threshold: int, swapped: bool) -> None:
    counted = hang_strikes("n0", hangs, now_s=10 * HOUR, window_s=24 * HOUR)
    assert counted == strikes
    assert quarantine_after_hangs(counted, threshold) is swapped


FAILS_AT_START = {  # name: (failures in a row with no step between them, the budget, whether the run is failed)
    "a first failure": (1, 3, False),
    "a relaunch that failed at start once": (2, 3, False),
    "the budget spent": (3, 3, True),
    "past it (a controller that took over)": (5, 3, True),
    "a budget of one: the first failure is the last": (1, 1, True),
    "no budget: relaunched for ever": (50, 0, False),
}


@pytest.mark.parametrize(("failures", "budget", "fails"), FAILS_AT_START.values(), ids=FAILS_AT_START.keys())
def test_a_job_that_fails_at_start(failures: int, budget: int, fails: bool) -> None:
    assert fails_at_start(failures, budget) is fails
