"""The monitor on real multi-rank runs of the reference trainer: collectives land on the right dimension, the
reports follow the wire format, and monitoring changes nothing in training (a missing agent socket only counts
drops)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.launch import run_module
from trainer_hooks.wire import decode

pytestmark = pytest.mark.slow

STEPS = 3
LAYERS = 4  # the trainer's default


def run(
    tmp: Path, nproc: int, mesh: str, *extra: str, monitor: bool = True
) -> tuple[list[float], list[list[dict[str, Any]]]]:
    out = tmp / f"losses-{monitor}.json"
    args = ["--mesh", mesh, "--steps", str(STEPS), "--losses-out", str(out), *extra]
    if monitor:
        args += ["--opsd-monitor", "--opsd-jsonl", str(tmp / "rank{rank}.jsonl")]
    proc = run_module("examples.train", args, nproc=nproc, env={"OPSD_AGENT_SOCKET": str(tmp / "no-agent.sock")})
    assert proc.returncode == 0, proc.stderr[-4000:]
    losses = json.loads(out.read_text())["losses"]
    reports = []
    if monitor:
        for rank in range(nproc):
            lines = (tmp / f"rank{rank}.jsonl").read_bytes().splitlines()
            reports.append([decode(line) for line in lines])
    return losses, reports


def comms(report: dict[str, Any]) -> dict[tuple[str, str], tuple[int, int]]:
    return {(dim, op): (count, nbytes) for dim, op, count, nbytes, _ in report["comms"]}


# mesh -> (ranks, extra args, {(dimension, op): expected count per step or None for "at least one"})
CASES: dict[str, tuple[int, tuple[str, ...], dict[tuple[str, str], int | None]]] = {
    "dp_shard=2,tp=2": (
        4,
        (),
        {
            # 2 row-parallel all-reduces forward, 5 column-parallel input-gradient all-reduces backward, per block
            ("tp", "all_reduce"): 7 * LAYERS,
            ("dp_shard", "reduce_scatter"): LAYERS + 1,  # one per FSDP unit (blocks and root)
            ("dp_shard", "all_gather"): None,
        },
    ),
    "cp=2,dp_shard=2": (4, (), {("cp", "all_gather"): 2 * LAYERS, ("cp", "reduce_scatter"): 2 * LAYERS}),
    "ep=2,dp_shard=2": (4, ("--experts", "4"), {("ep", "all_to_all"): None}),
    "dp_replicate=2,dp_shard=2": (4, (), {("dp_replicate", "all_reduce"): None, ("dp_shard", "reduce_scatter"): None}),
    # 1F1B with 2 micro-batches: each stage sends and receives one tensor per micro-batch (activations forward,
    # their gradients backward).
    "pp=2,dp_shard=2": (4, (), {("pp", "send"): 2, ("pp", "recv"): 2, ("dp_shard", "reduce_scatter"): None}),
}


@pytest.mark.parametrize("mesh", CASES)
def test_collectives_attributed_to_their_dimension(tmp_path: Path, mesh: str) -> None:
    nproc, extra, expected = CASES[mesh]
    _, reports = run(tmp_path, nproc, mesh, *extra)
    for rank_reports in reports:
        assert [r["step"] for r in rank_reports] == list(range(1, STEPS + 1))
        last = rank_reports[-1]
        seen = comms(last)
        for key, count in expected.items():
            assert key in seen, f"{key} missing on rank {last['rank']}: {sorted(seen)}"
            assert seen[key][1] > 0
            if count is not None:
                assert seen[key][0] == count, f"{key}: {seen[key][0]} != {count}"
        assert last["step_s"] > 0
        assert last["compute_s"] == pytest.approx(last["step_s"] - last["exposed_comm_s"])
        assert 0 < last["mfu_ratio"] < 1
        assert last["internal_errors_total"] == 0
        # The agent socket does not exist: every report is dropped (a report counts the drops before it).
        assert last["dropped_reports_total"] == STEPS - 1


def test_monitor_changes_nothing_in_training(tmp_path: Path) -> None:
    with_monitor, _ = run(tmp_path, 4, "dp_shard=2,tp=2")
    without, _ = run(tmp_path, 4, "dp_shard=2,tp=2", monitor=False)
    assert with_monitor == without
