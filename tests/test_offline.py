"""A run's record after ``opsd run`` has exited: a real run of the reference trainer under ``opsd run`` (a rank
killed through ``opsd inject`` half-way), then the operator's read commands with no controller running: they read
the state store (``opsd.cli.offline``), and ``opsd run`` said how. And the reader's rules: the store only when no
controller answers, never for a write."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from bench.crash_rates import stop
from opsd.backends.local.processes import free_port
from opsd.cli.app import app
from opsd.cli.client import UnreachableError
from opsd.cli.offline import Reader, StoreClient, store_url
from opsd.controller.rows import RunSpec
from opsd.controller.state import StateStore
from opsd.errors import PermanentError
from opsd.protocol.states import FAILURE_KINDS
from tests.waiting import wait_for

RUN = "offline"
STEPS = 50


def opsd(*args: str) -> Any:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


@pytest.mark.slow
def test_a_finished_runs_incidents_postmortem_and_flame_graph_need_no_controller(tmp_path: Path) -> None:
    port, state = free_port(), tmp_path / "state"
    url, ckpt = f"http://127.0.0.1:{port}", f"file://{tmp_path / 'ckpt'}"
    trainer = [sys.executable, "-m", "examples.train", "--mesh", "dp_shard=2", "--steps", str(STEPS)]
    trainer += ["--opsd-monitor", "--ckpt-dir", ckpt, "--ckpt-every", "10", "--resume"]
    command = [sys.executable, "-m", "opsd", "run", "--run", RUN, "--nodes", "2", "--gpus-per-node", "1"]
    command += ["--spares", "1", "--port", str(port), "--state-dir", str(state), "--checkpoint-url", ckpt]
    proc = subprocess.Popen(
        [*command, "--", *trainer], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )

    def killed_past_step_23() -> bool:
        """Rank 1 killed, once training is past the checkpoint of step 20."""
        where = ("--url", url, "--state-dir", str(state))
        status = opsd("status", RUN, "--json", *where)
        if status.exit_code != 0 or json.loads(status.stdout)["step"] < 23:
            return False
        return opsd("inject", "kill", "--rank", "1", "--run", RUN, *where).exit_code == 0

    try:
        wait_for(
            "kill past step 23",
            killed_past_step_23,
            180,
            alive=proc,
            context=lambda: "" if proc.poll() is None else str(proc.communicate()),
            interval_s=0.5,
        )
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:  # SIGTERM: opsd run stops its ranks and agents (a SIGKILL would leave them running)
            stop(proc, 60.0)
    assert proc.returncode == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["state"] == "completed"
    assert f"opsd postmortem {RUN} --state-dir {state} --format html" in err  # what to type, once it is over

    offline = ("--url", url, "--state-dir", str(state))  # nothing listens there any more
    incidents = opsd("incidents", RUN, "--json", *offline)
    assert incidents.exit_code == 0, incidents.output
    every = json.loads(incidents.stdout)  # a straggler warning may come with a loaded machine; one failure only
    failures = [(i["kind"], i["state"]) for i in every if i["kind"] in FAILURE_KINDS]
    assert failures == [("process_exit", "recovered")], every
    assert "reading the state store" in incidents.stderr

    status = json.loads(opsd("status", RUN, "--json", *offline).stdout)
    assert status["state"] == "completed"
    assert status["last_measured"]["launch"] == 2
    assert status["last_measured"]["mfu_ratio"] > 0
    assert status["run_average"]["samples"] >= 2

    md = opsd("postmortem", RUN, *offline)
    assert md.exit_code == 0, md.output
    assert "Where launch 1's collective time went" in md.stdout
    assert "dp_shard" in md.stdout
    assert "failure in" in md.stdout  # the MTBF with its inputs
    assert "(last measured, launch 2)" in md.stdout

    for launch in ("1", "2"):
        stacks = opsd("flamegraph", RUN, "--json", "--launch", launch, *offline)
        assert stacks.exit_code == 0, stacks.output
        assert any(s["stack"][2] == "dp_shard" and s["us"] > 0 for s in json.loads(stacks.stdout))
    svg = tmp_path / "run.svg"
    assert opsd("flamegraph", RUN, "--out", str(svg), *offline).exit_code == 0
    assert "<svg" in svg.read_text()

    refused = opsd("restart", RUN, "--reason", "too late", *offline)
    assert refused.exit_code == 1
    assert "needs a running controller" in refused.output


class Refusing:
    """A controller that answers with an error (``PermanentError``), or cannot be reached (``UnreachableError``)."""

    url = "http://127.0.0.1:9"

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.calls = 0

    def get(self, path: str) -> Any:
        self.calls += 1
        raise self.error

    def get_text(self, path: str) -> str:
        raise self.error

    def post(self, path: str, body: Mapping[str, object] | None = None) -> Any:
        raise self.error


def test_the_store_answers_as_the_controller_would_and_only_when_none_answers(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'opsd.db'}"
    store = StateStore.open(url)
    store.create_run("r", RunSpec(min_nodes=1), 1.0)
    said: list[str] = []
    dead = Refusing(UnreachableError("refused"))
    down = Reader(dead, url, said.append)
    assert [r["id"] for r in down.get("/v1/runs")] == ["r"]
    assert down.get("/v1/runs/r")["state"] == "running"
    assert dead.calls == 1  # asked once; then the store, and said so once
    assert len(said) == 1
    assert "reading the state store" in said[0]
    with pytest.raises(PermanentError, match="404 no run 'nope'"):
        down.get("/v1/runs/nope")
    with pytest.raises(PermanentError, match="needs a running controller"):
        down.post("/v1/runs/r/restart", {"reason": "x"})
    with pytest.raises(PermanentError, match="needs a running controller"):
        StoreClient(url).post("/v1/runs/r/restart", {"reason": "x"})

    refusing = Refusing(PermanentError("409 refused"))  # it answered: its answer stands
    with pytest.raises(PermanentError, match="409"):
        Reader(refusing, url, said.append).get("/v1/runs")
    with pytest.raises(UnreachableError):  # no store to fall back on
        Reader(Refusing(UnreachableError("refused")), None, said.append).get("/v1/runs")


def test_the_state_store_is_the_flag_or_the_state_directorys(tmp_path: Path) -> None:
    assert store_url(str(tmp_path), None) is None  # nothing there
    StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}")
    assert store_url(str(tmp_path), None) == f"sqlite:///{tmp_path / 'opsd.db'}"
    assert store_url(str(tmp_path), "postgresql+psycopg://h/db") == "postgresql+psycopg://h/db"
