"""Goodput accounting and ETTR, as tables of named cases."""

from __future__ import annotations

import pytest

from opsd.policy.goodput import Interruption, Startup, account

CASES = {
    # name: (wall_s, checkpoint_s, start-up (None: not counted), interruptions, expected buckets)
    "no failure": (1000.0, 50.0, None, [], {"productive": 950.0, "checkpoint": 50.0}),
    "one failure": (
        1000.0,
        0.0,
        None,
        [Interruption(failed_s=100, detected_s=103, resumed_s=143, lost_steps=5, step_time_s=2.0)],
        {"productive": 947.0, "detection": 3.0, "restart": 40.0, "recompute": 10.0},
    ),
    "waiting for a spare is its own bucket": (
        1000.0,
        0.0,
        None,
        [Interruption(failed_s=0, detected_s=10, resumed_s=110, lost_steps=0, step_time_s=1.0, spare_wait_s=60)],
        {"productive": 890.0, "detection": 10.0, "spare_wait": 60.0, "restart": 40.0},
    ),
    "launch and initialisation until the first step": (
        1000.0,
        0.0,
        Startup(started_s=100.0, first_productive_s=130.0),
        [],
        {"productive": 970.0, "startup": 30.0},
    ),
    "not stepped yet: all of it": (50.0, 0.0, Startup(started_s=100.0, first_productive_s=None), [], {"startup": 50.0}),
    "a failure during the start-up ends it; its relaunch is the interruption's": (
        1000.0,
        0.0,
        Startup(started_s=100.0, first_productive_s=260.0),
        [Interruption(failed_s=120, detected_s=125, resumed_s=260, lost_steps=0, step_time_s=1.0)],
        {"productive": 840.0, "startup": 20.0, "detection": 5.0, "restart": 135.0},
    ),
    "a failure after the first step leaves the start-up alone": (
        1000.0,
        0.0,
        Startup(started_s=100.0, first_productive_s=110.0),
        [Interruption(failed_s=500, detected_s=501, resumed_s=531, lost_steps=4, step_time_s=2.0)],
        {"productive": 951.0, "startup": 10.0, "detection": 1.0, "restart": 30.0, "recompute": 8.0},
    ),
    # a replica recovery of 1 group of 4: its share of the job is down; the 3 others waited for a quorum and
    # discarded 2 steps around it, which they did again (3/4 of the job's step, twice)
    "a replica recovery: the other groups' discarded steps are recomputed at their share": (
        1000.0,
        0.0,
        None,
        [
            Interruption(
                failed_s=100,
                detected_s=104,
                resumed_s=144,
                lost_steps=0,
                step_time_s=2.0,
                share=0.25,
                stall_s=3.0,
                discarded_steps=2,
            )
        ],
        {"productive": 983.0, "detection": 1.0, "restart": 10.0, "recompute": 3.0, "quorum": 3.0},
    ),
}


@pytest.mark.parametrize(("wall", "ckpt", "startup", "interruptions", "expected"), CASES.values(), ids=CASES.keys())
def test_account(
    wall: float, ckpt: float, startup: Startup | None, interruptions: list[Interruption], expected: dict[str, float]
) -> None:
    g = account(wall, ckpt, interruptions, startup)
    assert {k: v for k, v in g.buckets().items() if v} == pytest.approx(expected)
    assert sum(g.buckets().values()) == pytest.approx(wall)
    assert g.ettr == pytest.approx(expected.get("productive", 0.0) / wall)


def test_a_startup_ends_after_it_begins() -> None:
    with pytest.raises(ValueError, match="started_s <= first_productive_s"):
        Startup(started_s=10.0, first_productive_s=5.0)


def test_interruption_validates_itself() -> None:
    with pytest.raises(ValueError, match="failed_s <= detected_s"):
        Interruption(failed_s=10, detected_s=5, resumed_s=20, lost_steps=0, step_time_s=1)
