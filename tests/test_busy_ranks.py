"""Do no harm: a rank that waits for a long checkpoint save says so, and the controller judges no hang meanwhile. A
real ``opsd run`` of the reference trainer, 2 nodes x 1 rank (``opsd run``'s hang floor: 6 s), synchronous saves
every 20 steps; the manifest of step 40 is held up 15 s on rank 0 (a slow store), so every rank stops stepping for
15 s: rank 0 in its save, rank 1 in the next step's all-reduce, waiting for it. Asserted: the save of step 40 did take
that long (the run's step stayed put), the save committed, no failure incident is opened, the run is never
relaunched and completes. Without the rank's word (``Monitor.activity``, said through the checkpointer's
``on_busy``) the same test failed: the run never passed step 50 in 180 s (the stall judged a hang, the ranks stopped
and relaunched in their save, from the checkpoint of step 20, into the same held save)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from bench.crash_rates import stop
from opsd.backends.local.processes import free_port
from opsd.checkpoints.layout import step_dir_name
from opsd.cli.app import app
from opsd.protocol.manifest import MANIFEST_NAME
from opsd.protocol.states import FAILURE_KINDS
from tests.waiting import wait_for

RUN = "slowsave"
HELD_S = 15.0


def opsd(*args: str) -> Any:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


@pytest.mark.slow
def test_a_long_save_the_ranks_wait_for_is_no_hang(tmp_path: Path) -> None:
    port, state, ckpt = free_port(), tmp_path / "state", tmp_path / "ckpt"
    url, last_step = f"http://127.0.0.1:{port}", tmp_path / "last-step"
    trainer = [sys.executable, "-m", "examples.train", "--mesh", "dp_shard=2", "--steps", "100000"]
    trainer += ["--steps-file", str(last_step), "--opsd-monitor", "--ckpt-dir", str(ckpt), "--ckpt-every", "20"]
    trainer += ["--ckpt-sync", "--slow-commit-step", "40", "--slow-commit-s", str(HELD_S)]
    command = [sys.executable, "-m", "opsd", "run", "--run", RUN, "--nodes", "2", "--gpus-per-node", "1"]
    command += ["--spares", "0", "--port", str(port), "--state-dir", str(state)]
    proc = subprocess.Popen(
        [*command, "--", *trainer], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    where = ("--url", url, "--state-dir", str(state))

    seen: list[tuple[float, int]] = []  # (when, the run's step) at each look

    def status() -> dict[str, Any] | None:
        answer = opsd("status", RUN, "--json", *where)
        found = json.loads(answer.stdout) if answer.exit_code == 0 else None
        if found is not None:
            seen.append((time.monotonic(), int(found["step"])))
        return found

    def context() -> str:
        return "" if proc.poll() is None else str(proc.communicate())

    try:
        wait_for(
            "a step past the held save",
            lambda: (s := status()) is not None and s["step"] >= 50,
            180,
            alive=proc,
            context=context,
            interval_s=0.5,
        )
        last_step.write_text("60")
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:  # SIGTERM: opsd run stops its ranks and agents
            stop(proc, 60.0)
    assert proc.returncode == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["state"] == "completed"
    assert (ckpt / step_dir_name(40) / MANIFEST_NAME).exists()  # the held save committed
    longest_s, since = 0.0, seen[0]  # the longest time the run's step stayed the same, as the looks saw it
    for at_s, step in seen[1:]:
        since = since if step == since[1] else (at_s, step)
        longest_s = max(longest_s, at_s - since[0])
    assert longest_s >= HELD_S - 2.0, seen  # the run stopped stepping for more than 2 x the 6 s hang floor
    incidents = json.loads(opsd("incidents", RUN, "--json", *where).stdout)
    failures = [i for i in incidents if i["kind"] in FAILURE_KINDS]
    assert failures == [], json.dumps(failures, indent=1)[-3000:]
    final = json.loads(opsd("status", RUN, "--json", *where).stdout)
    assert final["last_measured"]["launch"] == 1  # never relaunched
