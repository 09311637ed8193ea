"""The recoveries, for real: `opsd run`'s controller and local backend run the reference trainer on 2 nodes x 1 rank
(``dp_shard=2``) with a spare, and faults are injected the way `opsd inject` does, one after the other:

1. two clean minutes: no rank is flagged as a straggler;
2. rank 1 slowed down 1.3x (SIGSTOP/SIGCONT duty cycle): flagged, on rank 1 and node-1, within 60 s;
3. rank 0 hung (SIGSTOP): detected within max(3 x median step, 10 s), the ranks are relaunched and progress again;
4. rank 1 killed (SIGKILL): detected, relaunched, progress again.

One rank per node: with 2 cores, 4 CPU ranks would compete for them and the competition alone makes some rank
look 10-20% slower now and then (a clean run would not stay clean for reasons of this machine, not of the ranks).
"""

from __future__ import annotations

import statistics
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from opsd.controller import Controller
from opsd.errors import PermanentError
from opsd.local import LocalBackend, LocalRunSpec, free_port
from opsd.runner import run_local
from opsd.server import ServeConfig

pytestmark = pytest.mark.slow

RUN = "faults"
CLEAN_S = 120.0
FLAG_WITHIN_S = 60.0
HANG_FLOOR_S = 10.0  # the check: detected within max(3 x median step, 10 s)
PHASE_LIMIT_S = 90.0  # a phase that takes longer ends the scenario (and fails the test)


@dataclass
class Scenario:
    """Drives the faults from the runner's poll loop and writes down what the controller saw, and when."""

    stop: threading.Event = field(default_factory=threading.Event)
    phase: str = "clean"
    times: dict[str, float] = field(default_factory=dict)
    clean_flags: list[Any] = field(default_factory=list)
    median_step_s: float = 0.0
    problem: str = ""

    def __call__(self, controller: Controller, backend: LocalBackend, now_s: float) -> None:
        status = controller.status(RUN, now_s)
        assert status is not None
        incidents = controller.store.incidents(RUN)
        if self.phase == "clean":
            if status["step"] > 0:
                self.times.setdefault("clean", now_s)
            self.clean_flags += status["stragglers"] + [i for i in incidents if i["kind"] == "straggler"]
            if now_s - self.times.get("clean", now_s) >= CLEAN_S:
                self._next("slow", now_s, lambda: backend.inject("slow", rank=1, factor=1.3))
        elif self.phase == "slow":
            if any(i["kind"] == "straggler" for i in incidents):
                self.times["flagged"] = now_s
                steps = [t for r in controller.ranks[RUN].values() for t in r.step_times_s]
                self.median_step_s = statistics.median(steps)
                self._next("hang", now_s, lambda: backend.inject("hang", rank=0))
        elif self.phase == "hang":
            if _recovered(incidents, "hang"):
                self._next("kill", now_s, lambda: backend.inject("kill", rank=1))
        elif self.phase == "kill" and _recovered(incidents, "process_exit"):
            self.phase = "done"
            self.stop.set()
        if self.phase not in ("clean", "done") and now_s - self.times[self.phase] > PHASE_LIMIT_S:
            self.problem = f"phase {self.phase} did not end within {PHASE_LIMIT_S:.0f} s"
            self.stop.set()

    def _next(self, phase: str, now_s: float, inject: Any) -> None:
        try:
            inject()
        except PermanentError:
            return  # the rank is not running (yet): again at the next poll
        self.phase = phase
        self.times[phase] = now_s


def _recovered(incidents: list[dict[str, Any]], kind: str) -> bool:
    return any(i["kind"] == kind and i["state"] == "recovered" for i in incidents)


def two_nodes(tmp_path: Path, *trainer_options: str, **config: Any) -> tuple[ServeConfig, LocalRunSpec]:
    """2 nodes x 1 rank and a spare running the reference trainer until stopped (checkpoints every 20 steps)."""
    ckpt, port = f"file://{tmp_path / 'ckpt'}", free_port()
    command = (
        *(sys.executable, "-m", "examples.train", "--mesh", "dp_shard=2", "--steps", "1000000", "--opsd-monitor"),
        *(*trainer_options, "--ckpt-dir", ckpt, "--ckpt-every", "20", "--resume"),
    )
    serve = ServeConfig(port=port, state_dir=str(tmp_path / "state"), tick_interval_s=0.25, **config)
    spec = LocalRunSpec(
        run=RUN,
        command=command,
        nodes=2,
        gpus_per_node=1,
        spares=1,
        workdir=str(tmp_path / "runs"),
        controller_url=f"http://127.0.0.1:{port}/v1/heartbeat",
        checkpoint_url=ckpt,
    )
    return serve, spec


def test_stragglers_hangs_and_killed_ranks(tmp_path: Path) -> None:
    # the detection latency (a heartbeat, a pass) fits in the 2 s above the floor
    config, spec = two_nodes(tmp_path, heartbeat_floor_s=3.0, hang_floor_s=HANG_FLOOR_S - 2.0)
    scenario = Scenario()
    status = run_local(config, spec, on_poll=scenario, stop=scenario.stop, timeout_s=600)
    assert not scenario.problem, (scenario.problem, scenario.times, status)
    assert (scenario.phase, status["state"]) == ("done", "stopped")

    assert scenario.clean_flags == []  # 1. two clean minutes flag nothing
    assert scenario.times["slow"] - scenario.times["clean"] >= CLEAN_S

    incidents = {i["kind"]: i for i in status["incidents"]}
    after = {kind: (i["detected_s"], i["resumed_s"]) for kind, i in incidents.items()}
    print(  # the figures, for -s
        f"straggler flagged {after['straggler'][0] - scenario.times['slow']:.1f} s after the slowdown;"
        f" hang detected {after['hang'][0] - scenario.times['hang']:.1f} s after the SIGSTOP"
        f" (median step {scenario.median_step_s:.3f} s), first step {after['hang'][1] - scenario.times['hang']:.1f} s"
        f" after; kill detected {after['process_exit'][0] - scenario.times['kill']:.1f} s after,"
        f" first step {after['process_exit'][1] - scenario.times['kill']:.1f} s after"
    )
    assert sorted(incidents) == ["hang", "process_exit", "straggler"]

    straggler = incidents["straggler"]  # 2. the slowed rank, within 60 s
    assert (straggler["rank"], straggler["node"], straggler["state"]) == (1, "node-1", "warned")
    assert straggler["detected_s"] - scenario.times["slow"] <= FLAG_WITHIN_S

    hang = incidents["hang"]  # 3. detected within max(3 x median step, 10 s); relaunched; progress again
    limit_s = max(3 * scenario.median_step_s, HANG_FLOOR_S)
    assert 0 < hang["detected_s"] - scenario.times["hang"] <= limit_s, (hang, scenario.times)
    assert hang["resumed_s"] > hang["detected_s"]

    killed = incidents["process_exit"]  # 4. the killed rank: its exit is the cause; relaunched; progress again
    assert (killed["rank"], killed["node"]) == (1, "node-1")
    assert "exited with -9" in killed["detail"]
    assert killed["resumed_s"] > killed["detected_s"] >= scenario.times["kill"]

    assert status["generation"] == 3  # the first launch and one relaunch per failure, no swap
    assert [n["role"] for n in status["nodes"]] == ["active", "active", "spare"]


def test_a_collective_timeout_names_the_rank_its_peers_wait_for(tmp_path: Path) -> None:
    """Rank 0 is stopped (SIGSTOP); rank 1 waits for it in a collective and, after 2 s, says so. The controller
    names rank 0 (the rank that does not wait) long before the hang timeout (60 s here), and recovers."""
    config, spec = two_nodes(tmp_path, "--opsd-collective-timeout-s", "2", hang_floor_s=60.0)
    stop = threading.Event()
    stopped_at: dict[str, float] = {}

    def on_poll(controller: Controller, backend: LocalBackend, now_s: float) -> None:
        status = controller.status(RUN, now_s)
        assert status is not None
        if "hang" not in stopped_at and status["step"] >= 20:
            backend.inject("hang", rank=0)
            stopped_at["hang"] = now_s
        if (
            any(i["state"] == "recovered" for i in controller.store.incidents(RUN))
            or now_s - stopped_at.get("hang", now_s) > 50
        ):
            stop.set()

    status = run_local(config, spec, on_poll=on_poll, stop=stop, timeout_s=300)
    (incident,) = status["incidents"]
    assert (incident["kind"], incident["rank"], incident["node"], incident["state"]) == (
        "collective_timeout",
        0,
        "node-0",
        "recovered",
    )
    assert "rank 1 waited" in incident["detail"]
    assert incident["detected_s"] - stopped_at["hang"] <= 6.0  # 2 s of waiting, then a watchdog round and a heartbeat
