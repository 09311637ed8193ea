"""The reference trainer's ``--dtype``: bf16 computes in bfloat16 (FSDP2's mixed precision where the model is
sharded, autocast where it is not) and still learns what fp32 learns; fp32, the parity reference, is untouched.
Real runs on CPU (one process, and two gloo ranks with FSDP2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.launch import run_module

pytestmark = pytest.mark.slow

STEPS = 12


def run(tmp_path: Path, name: str, nproc: int, *argv: str) -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    proc = run_module("examples.train", ["--steps", str(STEPS), "--losses-out", str(out), *argv], nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def test_bf16_computes_in_bfloat16_and_learns_as_fp32_does(tmp_path: Path) -> None:
    fp32 = run(tmp_path, "fp32", 1)
    autocast = run(tmp_path, "bf16", 1, "--dtype", "bf16")
    sharded = run(tmp_path, "bf16-fsdp", 2, "--dtype", "bf16", "--mesh", "dp_shard=2")
    assert (fp32["autocast"], fp32["logits_dtype"]) == (None, ["float32"])
    assert (autocast["autocast"], autocast["logits_dtype"]) == ("bfloat16", ["bfloat16"])
    assert (sharded["autocast"], sharded["logits_dtype"]) == (None, ["bfloat16"])  # FSDP2 cast the weights
    for report in (autocast, sharded):
        losses = report["losses"]
        assert losses != fp32["losses"]  # not fp32 in disguise
        assert losses == pytest.approx(fp32["losses"], rel=0.03)  # bf16's precision, same learning
        assert losses[-1] < 0.8 * losses[0]
