"""Goodput accounting and ETTR, as tables of named cases."""

from __future__ import annotations

import pytest

from opsd.policy.goodput import Interruption, account

CASES = {
    # name: (wall_s, checkpoint_s, interruptions, expected buckets)
    "no failure": (1000.0, 50.0, [], {"productive": 950.0, "checkpoint": 50.0}),
    "one failure": (
        1000.0,
        0.0,
        [Interruption(failed_s=100, detected_s=103, resumed_s=143, lost_steps=5, step_time_s=2.0)],
        {"productive": 947.0, "detection": 3.0, "restart": 40.0, "recompute": 10.0},
    ),
    "waiting for a spare is its own bucket": (
        1000.0,
        0.0,
        [Interruption(failed_s=0, detected_s=10, resumed_s=110, lost_steps=0, step_time_s=1.0, spare_wait_s=60)],
        {"productive": 890.0, "detection": 10.0, "spare_wait": 60.0, "restart": 40.0},
    ),
}


@pytest.mark.parametrize(("wall", "ckpt", "interruptions", "expected"), CASES.values(), ids=CASES.keys())
def test_account(wall: float, ckpt: float, interruptions: list[Interruption], expected: dict[str, float]) -> None:
    g = account(wall, ckpt, interruptions)
    buckets = {k: v for k, v in g.buckets().items() if v}
    assert buckets == pytest.approx(expected)
    assert sum(g.buckets().values()) == pytest.approx(wall)
    assert g.ettr == pytest.approx(expected["productive"] / wall)


def test_interruption_validates_itself() -> None:
    with pytest.raises(ValueError, match="failed_s <= detected_s"):
        Interruption(failed_s=10, detected_s=5, resumed_s=20, lost_steps=0, step_time_s=1)
