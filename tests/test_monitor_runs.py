"""The monitor on real multi-rank runs of the reference trainer: collectives land on the right dimension, the
reports follow the wire format, and monitoring changes nothing in training (a missing agent socket only counts
drops)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from opsd.protocol.mesh import MeshSpec
from opsd.protocol.wire import decode
from tests.launch import run_module

pytestmark = pytest.mark.slow

STEPS = 3
# The trainer's default model and batch (examples.train): every expected count and size below follows from them.
LAYERS, DIM, SEQ, BATCH, KV_DIM = 4, 64, 32, 8, 2 * 16  # kv_dim = kv_heads x head_dim
F32 = 4


@dataclass
class Run:
    losses: list[float]
    reports: list[list[dict[str, Any]]]  # per rank, per step
    params: list[int]  # elements of the parameters each rank holds


def run(tmp: Path, nproc: int, mesh: str, *extra: str, monitor: bool = True) -> Run:
    out = tmp / f"losses-{monitor}.json"
    args = ["--mesh", mesh, "--steps", str(STEPS), "--losses-out", str(out), *extra]
    if monitor:
        args += ["--opsd-monitor", "--opsd-jsonl", str(tmp / "rank{rank}.jsonl")]
    env = {"OPSD_AGENT_SOCKET": str(tmp / "no-agent.sock")}
    proc = run_module("examples.train", args, nproc=nproc, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    reports = []
    if monitor:
        for rank in range(nproc):
            lines = (tmp / f"rank{rank}.jsonl").read_bytes().splitlines()
            reports.append([decode(line) for line in lines])
    params = [r["params"] for r in sorted(report["ranks"], key=lambda r: r["rank"])]
    return Run(report["losses"], reports, params)


def comms(report: dict[str, Any]) -> dict[tuple[str, str], tuple[int, int]]:
    """Counts and bytes per (dimension, op), over the phases."""
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for dim, op, count, nbytes, *_ in report["comms"]:
        before = out.get((dim, op), (0, 0))
        out[(dim, op)] = (before[0] + count, before[1] + nbytes)
    return out


Expected = dict[tuple[str, str], tuple[int, int | None]]  # (dimension, op) -> (count, bytes or None: any > 0)


def fsdp(shard_bytes: int, units: int, *, reshard: bool = True) -> Expected:
    """FSDP2 over the data-parallel shards: each unit (block or root) all-gathers its weights before forward and,
    when resharded after forward, again before backward; it reduce-scatters its gradients once. Sizes are the
    unsharded unit (the rank's shard x the FSDP group size)."""
    gathers = 2 * units if reshard else units
    return {
        ("dp_shard", "all_gather"): (gathers, shard_bytes * gathers // units),
        ("dp_shard", "reduce_scatter"): (units, shard_bytes),
    }


def expected(mesh: str, rank: int, params: list[int]) -> Expected:
    held = params[rank] * F32  # this rank's shard of every parameter, in bytes
    if mesh == "dp_shard=4":
        return fsdp(held * 4, LAYERS + 1)
    if mesh == "dp_replicate=2,dp_shard=2":
        # HSDP: reduce-scatter within the replica, then all-reduce of the shard across replicas
        return {**fsdp(held * 2, LAYERS + 1), ("dp_replicate", "all_reduce"): (LAYERS + 1, held)}
    if mesh == "dp_shard=2,tp=2":
        # per block: 2 row-parallel output all-reduces forward (attention wo, MLP w2), 5 column-parallel input
        # gradient all-reduces backward (wq wk wv w1 w3), each of the rank's [batch/dp, seq, dim] activations
        activation = BATCH // 2 * SEQ * DIM * F32
        return {**fsdp(held * 2, LAYERS + 1), ("tp", "all_reduce"): (7 * LAYERS, 7 * LAYERS * activation)}
    if mesh == "pp=2,dp_shard=2":
        # 1F1B, 2 micro-batches of batch/dp/2 sequences: one activation (or its gradient) per micro-batch each way;
        # weights stay gathered across micro-batches; each stage holds 2 blocks + its end (embedding or head)
        micro = BATCH // 2 // 2 * SEQ * DIM * F32
        return {
            **fsdp(held * 2, LAYERS // 2 + 1, reshard=False),
            ("pp", "send"): (2, 2 * micro),
            ("pp", "recv"): (2, 2 * micro),
        }
    if mesh == "pp=2,tp=2,dp_shard=2":
        # both of the above per stage: 2 blocks x 7 tp all-reduces per micro-batch, on micro-batch activations
        micro = BATCH // 2 // 2 * SEQ * DIM * F32
        return {
            **fsdp(held * 2, LAYERS // 2 + 1, reshard=False),
            ("pp", "send"): (2, 2 * micro),
            ("pp", "recv"): (2, 2 * micro),
            ("tp", "all_reduce"): (2 * 7 * LAYERS // 2, 2 * 7 * LAYERS // 2 * micro),
        }
    if mesh == "cp=2,dp_shard=2":
        # per block: K and V all-gathered over cp forward in one collective, their gradients reduce-scattered
        # backward in one; FSDP spans dp_shard x cp
        kv = BATCH // 2 * SEQ * KV_DIM * F32
        return {
            **fsdp(held * 4, LAYERS + 1),
            ("cp", "all_gather"): (LAYERS, 2 * LAYERS * kv),
            ("cp", "reduce_scatter"): (LAYERS, 2 * LAYERS * kv),
        }
    if mesh == "ep=2,dp_shard=2":
        # per MoE block: token counts, dispatch and combine forward; combine and dispatch again backward. Sizes
        # follow the routing. Expert weights are their own FSDP units over dp_shard.
        return {
            ("ep", "all_to_all"): (5 * LAYERS, None),
            ("dp_shard", "reduce_scatter"): (2 * LAYERS + 1, None),
            ("dp_shard", "all_gather"): (2 * (2 * LAYERS + 1), None),
        }
    raise AssertionError(mesh)


MESHES = {  # the foundation meshes -> extra arguments (tp and pp with dp_shard are checked together, in the last)
    "dp_shard=4": (),
    "dp_replicate=2,dp_shard=2": (),
    "cp=2,dp_shard=2": (),
    "ep=2,dp_shard=2": ("--experts", "4"),
    "pp=2,tp=2,dp_shard=2": (),
}


@pytest.mark.parametrize("mesh", MESHES)
def test_collectives_attributed_to_their_dimension(tmp_path: Path, mesh: str) -> None:
    result = run(tmp_path, MeshSpec.parse(mesh).world_size, mesh, *MESHES[mesh])
    for rank, rank_reports in enumerate(result.reports):
        assert [r["step"] for r in rank_reports] == list(range(1, STEPS + 1))
        last = rank_reports[-1]
        seen = comms(last)
        want = expected(mesh, rank, result.params)
        assert set(seen) == set(want), f"rank {rank}: {sorted(seen)} != {sorted(want)}"
        for key, (count, nbytes) in want.items():
            assert seen[key][0] == count, f"rank {rank} {key}: {seen[key][0]} ops, expected {count}"
            if nbytes is None:
                assert seen[key][1] > 0
            else:
                assert seen[key][1] == nbytes, f"rank {rank} {key}: {seen[key][1]} bytes, expected {nbytes}"
        assert last["step_s"] > 0
        assert last["compute_s"] == pytest.approx(last["step_s"] - last["exposed_comm_s"])
        assert 0 <= last["exposed_comm_s"] <= last["step_s"]
        assert 0 < last["mfu_ratio"] < 1
        assert last["memory"]["rss_bytes"] > 0
        assert last["coords"]["dp_shard"] in (0, 1, 2, 3)
        assert last["internal_errors_total"] == 0
        # The agent socket does not exist: every report is dropped (a report counts the drops before it).
        assert last["dropped_reports_total"] == STEPS - 1


def test_monitor_changes_nothing_in_training(tmp_path: Path) -> None:
    with_monitor = run(tmp_path, 4, "dp_shard=2,tp=2")
    without = run(tmp_path, 4, "dp_shard=2,tp=2", monitor=False)
    assert with_monitor.losses == without.losses
