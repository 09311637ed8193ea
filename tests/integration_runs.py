"""What the framework integrations' tests share (``tests/test_integrations_*.py``): the controller's cadence as the
agent writes it, a run reporting to a real node agent, and the series that agent must export."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from opsd.protocol.env import AGENT_SOCKET_ENV
from opsd.protocol.policy_file import CheckpointCadence, Policy, encode_policy
from opsd.protocol.wire import StepReport, decode_report
from opsd_agent.daemon import Agent, AgentConfig
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
