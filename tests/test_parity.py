"""Every parallel layout of the reference trainer computes what the single-process model computes.

Real multi-process runs on gloo (torchrun). For each layout the global loss of the first steps equals the
single-process loss on the same global batch (relative 1e-4), the loss falls over 20 steps, and every rank
holds only its part: fewer parameters than the model, and its data-parallel x context-parallel share of the
tokens. Together these show that each dimension really splits the work and still computes the same model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from opsd.protocol.mesh import MeshSpec
from tests.launch import run_module

pytestmark = pytest.mark.slow

STEPS = 20
PARITY_STEPS = 10
RTOL = 1e-4
MOE_ARGS = ("--experts", "4", "--top-k", "2")


def run_trainer(out: Path, nproc: int, mesh: str, *extra: str, steps: int = STEPS) -> dict[str, Any]:
    args = ["--mesh", mesh, "--steps", str(steps), "--losses-out", str(out), *extra]
    proc = run_module("examples.train", args, nproc=nproc)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    report: dict[str, Any] = json.loads(out.read_text())
    return report


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("reference")
    return {
        False: run_trainer(tmp / "dense.json", 1, ""),
        True: run_trainer(tmp / "moe.json", 1, "", *MOE_ARGS),
    }


# name: (ranks, mesh, MoE?, extra arguments). tp and pp with fsdp are checked together, in "pp+tp+fsdp".
LAYOUTS: dict[str, tuple[int, str, bool, tuple[str, ...]]] = {
    "fsdp": (4, "dp_shard=4", False, ()),
    "hsdp": (4, "dp_replicate=2,dp_shard=2", False, ()),
    "cp+fsdp": (4, "cp=2,dp_shard=2", False, ()),
    "ep+fsdp moe": (4, "ep=2,dp_shard=2", True, ()),
    "pp+tp+fsdp": (8, "pp=2,tp=2,dp_shard=2", False, ()),
    "pp gpipe+tp": (4, "pp=2,tp=2", False, ("--pp-schedule", "gpipe", "--microbatches", "4")),
    "hsdp+ep+cp moe": (8, "dp_replicate=2,ep=2,cp=2", True, ()),
}


@pytest.mark.parametrize(("nproc", "mesh", "moe", "extra"), LAYOUTS.values(), ids=LAYOUTS.keys())
def test_layout_matches_single_process(
    reference: dict[bool, dict[str, Any]],
    tmp_path: Path,
    nproc: int,
    mesh: str,
    moe: bool,
    extra: tuple[str, ...],
) -> None:
    report = run_trainer(tmp_path / "run.json", nproc, mesh, *(MOE_ARGS if moe else ()), *extra)
    expected = reference[moe]["losses"]
    losses = report["losses"]
    assert len(losses) == STEPS
    for step, (got, want) in enumerate(zip(losses[:PARITY_STEPS], expected[:PARITY_STEPS], strict=True)):
        assert got == pytest.approx(want, rel=RTOL), f"step {step + 1}: {got} != {want} ({mesh})"
    assert losses[-1] < 0.8 * losses[0], f"loss did not fall: {losses[0]} -> {losses[-1]}"

    ranks = report["ranks"]
    assert len(ranks) == nproc
    full, global_tokens = report["full_params"], report["global_tokens_per_step"]
    spec = MeshSpec.parse(mesh)
    for info in ranks:
        assert info["params"] < full, f"rank {info['rank']} holds the whole model ({mesh})"
        assert info["tokens_per_step"] == global_tokens // (spec.batch_shards * spec.cp)
    assert sum(info["params"] for info in ranks) >= full  # every weight is held somewhere


def test_single_process_reference_learns(reference: dict[bool, dict[str, Any]]) -> None:
    for report in reference.values():
        losses = report["losses"]
        assert losses[-1] < 0.8 * losses[0]
        assert report["ranks"][0]["params"] == report["full_params"]
