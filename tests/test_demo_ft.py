"""``make demo-ft``'s verdict (``opsd.cli.demo_ft``): each figure it prints can come out bad, and then it fails."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from opsd.cli.demo_ft import STALL_BOUND_S, Scenario, longest_gap, shortfalls
from tests.launch import ROOT

#: what a good run prints (the figures of one run here)
GOOD: dict[str, Any] = {
    "state": "completed",
    "incident": "fatal_xid",
    "replica_group": 1,
    "groups_relaunched": [1],
    "whole_job_restarts": 0,
    "checkpoint_reads": 0,
    "survivor_discarded_steps": 1,
    "survivor_stall_s": 2.398,
    "healed_to_step": 94,
    "replicas_equal": True,
    "final_step": 114,
    "incidents": [["fatal_xid", 1, 94], ["process_exit", 1, 140]],
}

# name: (what differs from a good run, the words of the shortfall)
BAD: dict[str, tuple[dict[str, Any], str]] = {
    "a whole-job restart besides the group's": ({"whole_job_restarts": 1}, "whole job was restarted 1 time"),
    "the relaunched group read a checkpoint": ({"checkpoint_reads": 1}, "read a checkpoint"),
    "group 0 stalled past the bound": ({"survivor_stall_s": STALL_BOUND_S + 0.1}, "longest time between two"),
    "group 0's stall unknown": ({"survivor_stall_s": None}, "was None s"),
    "group 1 never back": ({"healed_to_step": None}, "never stepped in the quorum again"),
    "both groups relaunched": ({"groups_relaunched": [0, 1]}, "groups relaunched: [0, 1]"),
    "the replicas differ": ({"replicas_equal": False}, "final states differ"),
    "the run failed": ({"state": "failed"}, "did not complete"),
    "the killed group not back": (
        {"incidents": [["fatal_xid", 1, 94], ["process_exit", 1, None]]},
        "killed rank's group 1 was not recovered",
    ),
}


def injected(tmp_path: Path) -> Scenario:
    scenario = Scenario(tmp_path / "last-step", tmp_path / "wedged", after_heal=20, then_kill=True)
    scenario.injected_s = 100.0
    return scenario


def test_a_good_run_passes(tmp_path: Path) -> None:
    assert shortfalls(GOOD, injected(tmp_path)) == []


@pytest.mark.parametrize("name", BAD)
def test_each_figure_can_fail_the_demo(name: str, tmp_path: Path) -> None:
    changed, words = BAD[name]
    missing = shortfalls({**GOOD, **changed}, injected(tmp_path))
    assert len(missing) == 1
    assert words in missing[0]


def test_no_injection_fails(tmp_path: Path) -> None:
    assert shortfalls(GOOD, Scenario(tmp_path / "last-step", tmp_path / "wedged", 20)) == ["no fault was injected"]


GAPS = {
    # name: (commit times, window, longest gap)
    "the gap across the window": ([1.0, 2.0, 9.0, 9.5], (3.0, 4.0), 7.0),
    "gaps outside the window left out": ([1.0, 8.0, 8.5, 9.0], (8.2, 8.7), 0.5),
    "a gap that starts in the window counts": ([1.0, 2.0, 5.0], (1.5, 2.5), 3.0),
    "unordered times": ([9.0, 1.0, 2.0], (0.0, 10.0), 7.0),
    "one time: none": ([5.0], (0.0, 10.0), None),
}


@pytest.mark.parametrize(("times", "window", "expected"), GAPS.values(), ids=GAPS.keys())
def test_the_survivors_stall_is_its_longest_gap_around_the_failure(
    times: list[float], window: tuple[float, float], expected: float | None
) -> None:
    assert longest_gap(times, *window) == expected


@pytest.mark.slow
def test_make_demo_ft_passes_with_every_figure_inside_its_bound(tmp_path: Path) -> None:
    """The whole demo (controller, local backend, Lighthouse, two real torchft groups), with its second failure
    (``--then-kill``): group 1 hangs with its connections open and its node has an XID, then, once back, one of its
    ranks is killed. It exits 0, and its JSON says why: each failure recovered in group 1 alone and healed from
    group 0 (no whole-job restart, no checkpoint read), group 0's stall within the bound (it stopped waiting when
    opsd named group 1 failed), equal replicas at the end."""
    proc = subprocess.run(
        [sys.executable, "-m", "opsd.cli.demo_ft", "--workdir", str(tmp_path / "demo"), "--then-kill"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print({k: result[k] for k in ("survivor_discarded_steps", "survivor_stall_s", "heal_s", "heal_transfer_s")})
    assert [i[:2] for i in result["incidents"]] == [["fatal_xid", 1], ["process_exit", 1]]
    assert all(i[2] is not None for i in result["incidents"])  # each healed, back in the quorum
    assert (result["whole_job_restarts"], result["checkpoint_reads"], result["groups_relaunched"]) == (0, 0, [1])
    assert result["replicas_equal"] is True
    # group 0 discards the step in flight when group 1 fails (none when it waited at a quorum then); the controller
    # counts what it discarded as the incidents' lost steps, and recomputed work
    assert result["lost_steps"] == result["survivor_discarded_steps"]
    assert (result["badput_s"]["recompute"] > 0) == (result["lost_steps"] > 0)
    assert 0 < result["survivor_stall_s"] <= STALL_BOUND_S
    assert 0 < result["heal_transfer_s"] < result["heal_s"]
