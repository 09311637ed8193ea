"""What the framework integrations' tests share (``tests/test_integrations_*.py``): the controller's cadence as the
agent writes it, a run reporting to a real node agent, the series that agent must export, and a run supervised by
``opsd run`` that is killed and resumes from the framework's own checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from bench.crash_rates import stop
from opsd.backends.local.processes import free_port
from opsd.cli.app import app
from opsd.protocol.env import AGENT_SOCKET_ENV
from opsd.protocol.policy_file import CheckpointCadence, Policy, encode_policy
from opsd.protocol.states import FAILURE_KINDS
from opsd.protocol.wire import StepReport, decode_report
from opsd_agent.daemon import Agent, AgentConfig
from tests.launch import ROOT
from tests.waiting import wait_for

STEPS = 12


def reports(path: Path) -> list[StepReport]:
    found = [decode_report(line) for line in path.read_bytes().splitlines()]
    return [r for r in found if isinstance(r, StepReport)]


def cadence_every_3(factory: pytest.TempPathFactory) -> Path:
    """The controller's cadence, as the agent writes it: a save every 3 steps from step 3."""
    path = factory.mktemp("policy") / "policy.json"
    path.write_bytes(encode_policy(Policy(checkpoint=CheckpointCadence(every_steps=3, from_step=3))))
    return path


def run_with_agent(out: Path, train: Callable[[dict[str, str]], int]) -> None:
    """``train(env)`` with its ranks reporting to a node agent too (its /metrics in ``out/metrics.txt``)."""
    agent = Agent(AgentConfig(socket=str(out / "agent.sock"), metrics_port=0, node="local"))
    agent.start()
    try:
        assert train({AGENT_SOCKET_ENV: agent.config.socket}) == 0
        wait_for("every report at the agent", lambda: agent.stats.received >= 2 * STEPS, 10, interval_s=0.05)
        (out / "metrics.txt").write_bytes(agent.metrics_text())
    finally:
        agent.stop()


def check_the_agents_series(metrics: Path) -> None:
    """The series the agent exports for the reference trainer's ranks, for both ranks of a 2-rank DDP run."""
    samples = {
        (s.name, s.labels.get("rank"), s.labels.get("dimension")): s.value
        for family in text_string_to_metric_families(metrics.read_text())
        for s in family.samples
    }
    for rank in ("0", "1"):
        assert samples[("opsd_steps_total", rank, None)] == STEPS
        assert 0 < samples[("opsd_mfu_ratio", rank, None)] < 1
        assert samples[("opsd_collectives_total", rank, "dp_replicate")] == STEPS  # one bucket a step


def check_each_steps_report(path: Path, rank: int) -> list[StepReport]:
    """Rank ``rank`` of a 2-rank DDP run reported every optimizer step: 4 x 32 tokens, its place, a step time, an MFU,
    and one gradient all-reduce (the model's one bucket) as ``dp_replicate``; the reports."""
    steps = reports(path)
    assert [r.step for r in steps] == list(range(1, STEPS + 1))
    for r in steps:
        assert (r.world_size, r.tokens, r.coords) == (2, 4 * 32, {"dp_replicate": rank})  # batch 4 x 32 tokens
        assert r.step_s > 0
        assert 0 < r.mfu_ratio < 1
        (comm,) = [c for c in r.comms if c.dimension == "dp_replicate"]
        assert (comm.op, comm.count) == ("all_reduce", 1)
        assert comm.bytes > 0
    return steps


@dataclass(frozen=True)
class Supervised:
    """What a run of ``opsd run`` ended with: its status and incidents as the CLI answers them (JSON), and the
    trainer's reports and losses."""

    status: dict[str, Any]
    incidents: list[dict[str, Any]]
    out: Path


def under_opsd_run(out: Path, trainer: Sequence[str], timeout_s: float = 300.0) -> Supervised:
    """``trainer`` (a command whose ranks write ``out/rank{rank}.jsonl`` and ``out/losses.json``) run by ``opsd run``
    on 2 local nodes of one rank each, no spare: the controller detects, relaunches and resumes it until every rank
    exits 0; its record read back through the CLI once ``opsd run`` has exited."""
    state = out / "state"
    command = [sys.executable, "-m", "opsd", "run", "--run", "framework", "--nodes", "2", "--gpus-per-node", "1"]
    command += ["--spares", "0", "--port", str(free_port()), "--state-dir", str(state), "--", *trainer]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True
    )
    try:
        printed, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:  # SIGTERM: opsd run stops its ranks and agents (each in a session of its own)
        printed, err = stop(proc, 60.0)
        raise AssertionError(f"opsd run ran past {timeout_s} s: {err[-6000:]}") from None
    assert proc.returncode == 0, (printed[-2000:], err[-6000:])
    where = ("--state-dir", str(state), "--url", f"http://127.0.0.1:{free_port()}")  # no controller: the store

    def cli(*args: str) -> Any:
        answer = CliRunner().invoke(app, [*args, "--json", *where], env={"COLUMNS": "200"})
        assert answer.exit_code == 0, answer.output
        return json.loads(answer.stdout)

    return Supervised(cli("status", "framework"), cli("incidents", "framework"), out)


def check_killed_and_resumed(run: Supervised, expected_losses: Path, killed_at: int, resumed_from: int) -> None:
    """The run of ``under_opsd_run`` whose rank 0 was killed after step ``killed_at``: one ``process_exit``
    incident, recovered by a relaunch that resumed from the framework's own checkpoint of step ``resumed_from`` (as
    the ranks' reports say, and the incident), the steps in between lost, the run completed at its last step, and
    its losses from the step resumed on those of the run that was never killed."""
    assert (run.status["state"], run.status["step"], run.status["generation"]) == ("completed", STEPS, 2)
    (incident,) = [i for i in run.incidents if i["kind"] in FAILURE_KINDS]
    assert (incident["kind"], incident["state"], incident["rank"]) == ("process_exit", "recovered", 0)
    assert (incident["resumed_from_step"], incident["lost_steps"]) == (resumed_from, killed_at - resumed_from), incident
    for rank in (0, 1):
        after = [r for r in reports(run.out / f"rank{rank}.jsonl") if r.resumed_from_step == resumed_from]
        assert [r.step for r in after] == list(range(resumed_from + 1, STEPS + 1))
    expected = json.loads(expected_losses.read_text())
    got = json.loads((run.out / "losses.json").read_text())
    steps = [str(s) for s in range(resumed_from + 1, STEPS + 1)]
    assert {s: got[s] for s in steps} == {s: expected[s] for s in steps}
