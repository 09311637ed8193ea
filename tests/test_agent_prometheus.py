"""End to end: the reference trainer on 4 gloo ranks reports to a real agent, a real Prometheus scrapes the agent,
and what Prometheus holds agrees with the trainer's own JSONL reports."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from opsd.protocol.wire import decode
from opsd_agent.daemon import Agent, AgentConfig
from tests.launch import run_module
from tests.prometheus import PrometheusServer
from tests.test_docs import blocks
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

MESH = "dp_shard=2,tp=2"
RANKS = 4
STEPS = 12


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    a = Agent(AgentConfig(socket=str(tmp_path / "agent.sock"), metrics_port=0, node="local"))
    a.start()
    try:
        yield a
    finally:
        a.stop()


def by_rank(result: list[dict[str, object]]) -> dict[int, float]:
    return {int(s["metric"]["rank"]): float(s["value"][1]) for s in result}  # type: ignore[index]


def test_prometheus_sees_every_rank_and_dimension(tmp_path: Path, agent: Agent) -> None:
    with PrometheusServer(tmp_path, targets=[f"127.0.0.1:{agent.metrics_port}"]) as prom:
        jsonl_path = str(tmp_path / "r{rank}.jsonl")
        args = ["--mesh", MESH, "--steps", str(STEPS), "--opsd-monitor", "--opsd-jsonl", jsonl_path]
        env = {"OPSD_AGENT_SOCKET": agent.config.socket}
        proc = run_module("examples.train", args, nproc=RANKS, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]

        # every report reached the agent, and a scrape after the run has them all
        def steps() -> dict[int, float]:
            return by_rank(prom.query('opsd_steps_total{run="local"}'))

        every = dict.fromkeys(range(RANKS), float(STEPS))
        wait_for(
            "scrape of every rank's last step",
            lambda: steps() == every,
            30,
            context=lambda: f"scraped: {steps()}",
            interval_s=0.25,
        )
        assert agent.stats.rejected == dict.fromkeys(agent.stats.rejected, 0)

        jsonl = {r: [decode(x) for x in (tmp_path / f"r{r}.jsonl").read_bytes().splitlines()] for r in range(RANKS)}
        mfu = by_rank(prom.query("opsd_mfu_ratio"))
        step_s = by_rank(prom.query("opsd_step_seconds"))
        for rank in range(RANKS):
            last = jsonl[rank][-1]
            assert mfu[rank] == pytest.approx(last["mfu_ratio"])
            assert step_s[rank] == pytest.approx(last["step_s"])
            assert 0 < mfu[rank] < 1

        # collective time, bytes and counts of every dimension of the mesh, for every rank, as the JSONL sums them
        for metric, index in (("opsd_collectives_total", 2), ("opsd_collective_bytes_total", 3)):
            result = prom.query(f"sum by (rank, dimension) ({metric})")
            got = {(int(s["metric"]["rank"]), s["metric"]["dimension"]): float(s["value"][1]) for s in result}
            want: dict[tuple[int, str], float] = defaultdict(float)
            for rank, reports in jsonl.items():
                for r in reports:
                    for entry in r["comms"]:
                        want[(rank, entry[0])] += entry[index]
            assert got == dict(want), metric
            assert {dim for _, dim in got} == {"dp_shard", "tp"}
        seconds = prom.query("sum by (rank, dimension) (opsd_collective_seconds_total)")
        assert len(seconds) == RANKS * 2
        assert all(float(s["value"][1]) > 0 for s in seconds)
        coords = prom.query("opsd_rank_info")
        assert {(s["metric"]["rank"], s["metric"]["dp_shard"], s["metric"]["tp"]) for s in coords} == {
            ("0", "0", "0"),
            ("1", "0", "1"),
            ("2", "1", "0"),
            ("3", "1", "1"),
        }
        # the example queries of docs/metrics.md answer on real data
        (block,) = blocks("docs/metrics.md", "promql")
        queries = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
        assert len(queries) == 3
        for promql in queries:
            assert prom.query(promql), promql
