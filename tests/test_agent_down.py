"""Do no harm: an agent that goes quiet while its node's ranks train (paused as during a restart, an upgrade's roll, a
refused token) is an operations event, not a lost node. A real ``opsd run`` of the reference trainer, 2 nodes x 2
ranks and a spare: node-1's agent is stopped (SIGSTOP) for 15 s at step 20 or later, while the ranks train on and
their step reaches the controller through node-0's agent. Asserted: the run's step advances during the pause, no
failure incident is opened, no node is cordoned or swapped, the launch is the first one to the end, and the silence
is recorded once as an ``agent_down`` warning. Before the second witness (``opsd.policy.detection``), the same pause
opened ``heartbeat_loss`` on node-1 after ~3 s past the floor, swapped it for the spare and relaunched the run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from bench.crash_rates import stop
from opsd.backends.local.processes import free_port
from opsd.cli.app import app
from opsd.protocol.states import FAILURE_KINDS
from tests.waiting import wait_for

RUN = "quiet"
PAUSE_S = 15.0


def opsd(*args: str) -> Any:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


@pytest.mark.slow
def test_an_agent_paused_for_15_s_while_its_ranks_train_opens_no_incident(tmp_path: Path) -> None:
    port, state = free_port(), tmp_path / "state"
    url, last_step = f"http://127.0.0.1:{port}", tmp_path / "last-step"
    trainer = [sys.executable, "-m", "examples.train", "--mesh", "dp_shard=4", "--steps", "100000"]
    trainer += ["--steps-file", str(last_step), "--opsd-monitor"]
    command = [sys.executable, "-m", "opsd", "run", "--run", RUN, "--nodes", "2", "--gpus-per-node", "2"]
    command += ["--spares", "1", "--port", str(port), "--state-dir", str(state)]
    proc = subprocess.Popen(
        [*command, "--", *trainer], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    where = ("--url", url, "--state-dir", str(state))

    def status() -> dict[str, Any] | None:
        answer = opsd("status", RUN, "--json", *where)
        return json.loads(answer.stdout) if answer.exit_code == 0 else None

    def context() -> str:
        return "" if proc.poll() is None else str(proc.communicate())

    def wait(what: str, check: Any, timeout_s: float = 180) -> Any:
        return wait_for(what, check, timeout_s, alive=proc, context=context, interval_s=0.5)

    try:
        wait("step 20", lambda: (s := status()) is not None and s["step"] >= 20)
        (record,) = state.rglob("processes.json")
        agent = int(json.loads(record.read_text())["agents"]["node-1"][0])
        before = status()
        assert before is not None
        os.kill(agent, signal.SIGSTOP)
        paused_s = time.monotonic()
        try:
            during = wait("node-1's agent down", lambda: (s := status()) is not None and s["agents_down"] and s, 60)
            time.sleep(max(0.0, PAUSE_S - (time.monotonic() - paused_s)))
            end_of_pause = status()
        finally:
            os.kill(agent, signal.SIGCONT)
        assert end_of_pause is not None
        assert [d["node"] for d in during["agents_down"]] == ["node-1"]
        assert end_of_pause["step"] > before["step"] + 10  # the run trained on, and said so through node-0
        assert end_of_pause["state"] == "running"
        wait("node-1's agent heard from again", lambda: (s := status()) is not None and not s["agents_down"], 60)
        final = wait(
            "a step past the pause", lambda: (s := status()) is not None and s["step"] > end_of_pause["step"] and s
        )
        last_step.write_text(str(final["step"] + 5))
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:  # SIGTERM: opsd run stops its ranks and agents (a SIGKILL would leave them running)
            stop(proc, 60.0)
    assert proc.returncode == 0, err[-3000:]
    ended = json.loads(out.strip().splitlines()[-1])
    assert ended["state"] == "completed"
    offline = opsd("incidents", RUN, "--json", *where)
    assert offline.exit_code == 0, offline.output
    incidents = json.loads(offline.stdout)
    failures = [i for i in incidents if i["kind"] in FAILURE_KINDS]
    assert failures == [], json.dumps(failures, indent=1)[-3000:]  # whole: its detail and times say what was judged
    assert [(i["kind"], i["node"], i["state"]) for i in incidents if i["kind"] == "agent_down"] == [
        ("agent_down", "node-1", "warned")
    ]
    final_status = json.loads(opsd("status", RUN, "--json", *where).stdout)
    assert final_status["last_measured"]["launch"] == 1  # never relaunched
    roles = {n["name"]: n["role"] for n in final_status["nodes"]}
    assert roles == {"node-0": "active", "node-1": "active", "node-2": "spare"}, roles
