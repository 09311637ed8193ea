"""`make demo` as a test: an XID 79 on a node of a running job is detected within 5 s, the node is swapped for the
spare, the ranks resume from the newest committed checkpoint within 60 s of the injection, the run completes, and
its final weights equal those of a run that was never interrupted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from opsd.demo import trainer_command
from tests.launch import ROOT, run_module

pytestmark = pytest.mark.slow


def test_the_demo_recovers_and_ends_with_the_weights_of_an_uninterrupted_run(tmp_path: Path) -> None:
    work = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "opsd.demo", "--workdir", str(work), "--steps", "80"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["state"] == "completed"
    assert result["incident"] == "fatal_xid"
    assert 0 <= result["detected_s"] <= 5.0
    assert result["recovered_s"] <= 60.0
    assert (result["nodes_swapped"], result["spare"]) == (1, "node-2")
    assert result["resumed_from_step"] >= 20  # the injection came after the checkpoint of step 20 was committed
    assert 0 < result["lost_steps"] <= 10  # at most the steps since that checkpoint (one is saved every 10)
    assert result["final_step"] == 80
    assert 0 < result["ettr"] < 1
    interrupted = json.loads((work / "losses.json").read_text())
    assert interrupted["resumed_from_step"] == result["resumed_from_step"]

    # the same job, never interrupted: torchrun, 4 ranks
    out = tmp_path / "straight.json"
    command = trainer_command(f"file://{tmp_path / 'straight-ckpt'}", 80, out)
    straight = run_module(command[2], command[3:], nproc=4)
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert json.loads(out.read_text())["state_hashes"] == interrupted["state_hashes"]
