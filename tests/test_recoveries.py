"""The recoveries, for real: `opsd run`'s controller and local backend run the reference trainer on 2 nodes x 1 rank
(``dp_shard=2``) with a spare, and faults are injected the way `opsd inject` does, one after the other:

1. two clean minutes: no rank is flagged as a straggler;
2. rank 1 slowed down 1.3x (SIGSTOP/SIGCONT duty cycle): flagged, on rank 1 and node-1, within 60 s;
3. rank 0 hung (SIGSTOP): detected within max(3 x median step, 10 s), the ranks are relaunched and progress again;
4. rank 1 killed (SIGKILL): detected, relaunched, progress again;
5. `opsd restart`: a checkpoint at the step the controller asks for, then every rank relaunched from it.

During the clean minutes the operator's read commands (`opsd runs`, `status`, `incidents`, `spares`,
`checkpoints`, `cadence`, `cordon`, `uncordon`) run against the live controller.

One rank per node: with 2 cores, 4 CPU ranks would compete for them and the competition alone makes some rank
look 10-20% slower now and then (a clean run would not stay clean for reasons of this machine, not of the ranks).
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from opsd.backends.local.backend import LocalBackend
from opsd.backends.local.spec import LocalRunSpec
from opsd.cli.app import app
from opsd.cli.demo_run import checkpoint_url, run_spec, serve_config
from opsd.controller.config import ControllerConfig
from opsd.controller.controller import Controller
from opsd.controller.port import FaultKind
from opsd.errors import PermanentError
from opsd.policy.cadence import CadenceConfig
from opsd.protocol.records import IncidentRow
from opsd.runtime.config import ServeConfig
from opsd.runtime.local import run_local
from tests.faults import inject
from tests.spares import implied_pool

pytestmark = pytest.mark.slow

RUN = "faults"
CLEAN_S = 120.0
FLAG_WITHIN_S = 60.0
HANG_FLOOR_S = 10.0  # the check: detected within max(3 x median step, 10 s)
PHASE_LIMIT_S = 90.0  # a phase that takes longer ends the scenario (and fails the test)
REPUBLISHED_STEPS = 500  # how long the ranks train under a cadence republished every few seconds (~40 s here)


@dataclass
class Scenario:
    """Drives the faults from the runner's poll loop and writes down what the controller saw, and when."""

    stop: threading.Event = field(default_factory=threading.Event)
    phase: str = "clean"
    times: dict[str, float] = field(default_factory=dict)
    clean_flags: list[Any] = field(default_factory=list)
    median_step_s: float = 0.0
    problem: str = ""
    cli: dict[str, Any] = field(default_factory=dict)
    url: str = ""
    state_dir: str = ""

    def __call__(self, controller: Controller, backend: LocalBackend, now_s: float) -> None:
        status = controller.status(RUN, now_s)
        assert status is not None
        incidents = controller.store.incidents(RUN)
        if self.phase == "clean":
            if status.step > 0:
                self.times.setdefault("clean", now_s)
            self.clean_flags += [*status.stragglers, *[i for i in incidents if i.kind == "straggler"]]
            if not self.cli and status.step >= 45:  # past the second checkpoint
                self.cli = operator_reads(self.url, self.state_dir)
            if now_s - self.times.get("clean", now_s) >= CLEAN_S:
                self._next("slow", now_s, lambda: inject(backend, FaultKind.SLOW, rank=1, factor=1.3))
        elif self.phase == "slow":
            if any(i.kind == "straggler" for i in incidents):
                self.times["flagged"] = now_s
                steps = [t for r in controller.ranks[RUN].values() for t in r.step_times_s]
                self.median_step_s = statistics.median(steps)
                self._next("hang", now_s, lambda: inject(backend, FaultKind.HANG, rank=0))
        elif self.phase == "hang":
            if _recovered(incidents, "hang"):
                hang = next(i for i in incidents if i.kind == "hang")
                self.cli["postmortem"] = cli_json(self.url, self.state_dir, "postmortem", RUN)
                md = CliRunner().invoke(
                    app, ["postmortem", RUN, str(hang.id), "--url", self.url, "--state-dir", self.state_dir]
                )
                self.cli["postmortem_md"] = (md.exit_code, md.stdout or md.output)
                self._next("kill", now_s, lambda: inject(backend, FaultKind.KILL, rank=1))
        elif self.phase == "kill" and _recovered(incidents, "process_exit"):
            if controller.checkpoint_step_ahead(RUN) is None:
                return  # the relaunched ranks have no step times yet: a restart now would skip its checkpoint
            self._next("restart", now_s, lambda: self.cli.update(restart=self.opsd("restart", RUN, "--reason", "test")))
        elif self.phase == "restart" and _recovered(incidents, "manual_restart"):
            self.phase = "done"
            self.stop.set()
        if self.phase not in ("clean", "done") and now_s - self.times[self.phase] > PHASE_LIMIT_S:
            self.problem = f"phase {self.phase} did not end within {PHASE_LIMIT_S:.0f} s"
            self.stop.set()

    def opsd(self, *args: str) -> Any:
        return cli_json(self.url, self.state_dir, *args, "--no-wait")

    def _next(self, phase: str, now_s: float, inject: Any) -> None:
        try:
            inject()
        except PermanentError:
            return  # the rank is not running (yet): again at the next poll
        self.phase = phase
        self.times[phase] = now_s


def cli_json(url: str, state_dir: str, *args: str) -> Any:
    """``opsd ARGS --json`` against the controller at ``url`` (the token from ``state_dir``)."""
    result = CliRunner().invoke(app, [*args, "--json", "--url", url, "--state-dir", state_dir])
    assert result.exit_code == 0, (args, result.output)
    return json.loads(result.stdout)


def operator_reads(url: str, state_dir: str) -> dict[str, Any]:
    out = {name: cli_json(url, state_dir, *args) for name, args in READS.items()}
    for verb in ("cordon", "uncordon"):  # the spare out of service and back
        extra = ["--reason", "maintenance"] if verb == "cordon" else []
        result = CliRunner().invoke(app, [verb, "node-2", *extra, "--url", url, "--state-dir", state_dir])
        out[verb] = (result.exit_code, result.output.strip())
    return out


READS = {
    "runs": ("runs",),
    "status": ("status", RUN),
    "all": ("status",),
    "incidents": ("incidents",),
    "spares": ("spares",),
    "checkpoints": ("checkpoints", RUN),
    "cadence": ("cadence", RUN),
}


def _recovered(incidents: list[IncidentRow], kind: str) -> bool:
    return any(i.kind == kind and i.state == "recovered" for i in incidents)


def two_nodes(
    tmp_path: Path, *trainer_options: str, flight_wait_s: float = 10.0, **detection: float
) -> tuple[ServeConfig, LocalRunSpec]:
    """2 nodes x 1 rank and a spare running the reference trainer until stopped (checkpoints every 20 steps)."""
    command = (
        *(sys.executable, "-m", "examples.train", "--mesh", "dp_shard=2", "--steps", "1000000", "--opsd-monitor"),
        *(*trainer_options, "--ckpt-dir", checkpoint_url(tmp_path), "--ckpt-every", "20", "--resume"),
    )
    serve = serve_config(tmp_path, flight_wait_s=flight_wait_s, **detection)
    return serve, run_spec(RUN, serve, tmp_path, command, gpus_per_node=1)


def test_stragglers_hangs_and_killed_ranks(tmp_path: Path) -> None:
    # the detection latency (a heartbeat, a pass) fits in the 2 s above the floor
    config, spec = two_nodes(tmp_path, heartbeat_floor_s=3.0, hang_floor_s=HANG_FLOOR_S - 2.0, flight_wait_s=4.0)
    scenario = Scenario(url=f"http://127.0.0.1:{config.port}", state_dir=config.state_dir)
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
    assert sorted(incidents) == ["hang", "manual_restart", "process_exit", "straggler"]

    straggler = incidents["straggler"]  # 2. the slowed rank, within 60 s
    assert (straggler["rank"], straggler["node"], straggler["state"]) == (1, "node-1", "warned")
    assert straggler["detected_s"] - scenario.times["slow"] <= FLAG_WITHIN_S

    hang = incidents["hang"]  # 3. detected within max(3 x median step, 10 s); relaunched; progress again
    limit_s = max(3 * scenario.median_step_s, HANG_FLOOR_S)
    assert 0 < hang["detected_s"] - scenario.times["hang"] <= limit_s, (hang, scenario.times)
    assert hang["resumed_s"] > hang["detected_s"]
    culprit = scenario.cli["postmortem"]["flight_recorder"][f"incident-{hang['id']}"]  # its Flight Recorder dumps
    assert (culprit["incident_id"], culprit["ranks_expected"], culprit["ranks_dumped"]) == (hang["id"], [0, 1], [1])
    assert [c["rank"] for c in culprit["culprits"]] == [0]  # the stopped rank sent none: it never joined
    assert culprit["culprits"][0]["reason"].startswith("sent no dump: never joined")
    assert any((g["group"], g["joined"], g["missing"]) == ("dp_shard", [1], [0]) for g in culprit["groups"])
    code, markdown = scenario.cli["postmortem_md"]
    assert code == 0, markdown
    assert "culprit rank" in markdown

    killed = incidents["process_exit"]  # 4. the killed rank: its exit is the cause; relaunched; progress again
    assert (killed["rank"], killed["node"]) == (1, "node-1")
    assert "exited with -9" in killed["detail"]
    assert killed["resumed_s"] > killed["detected_s"] >= scenario.times["kill"]

    restart = incidents["manual_restart"]  # 5. a checkpoint at the step asked for, then a relaunch from it
    assert restart["detail"] == "restart asked: test"
    assert scenario.cli["restart"]["incident"]["id"] == restart["id"]
    actions = {a["kind"]: a for a in status["actions"] if a["incident_id"] == restart["id"]}
    assert list(actions) == ["checkpoint", "stop", "launch"]
    saved = actions["checkpoint"]["result"]
    assert saved["checkpoint_step"] >= saved["asked_step"] > 0, saved
    assert restart["resumed_from_step"] == actions["launch"]["result"]["resumed_from_step"] >= saved["checkpoint_step"]
    assert restart["lost_steps"] < 20  # the newest checkpoint was moments old

    assert status["generation"] == 4  # the first launch and one relaunch per failure or restart, no swap
    assert [n["role"] for n in status["nodes"]] == ["active", "active", "spare"]
    check_operator_reads(scenario.cli)


def check_operator_reads(cli: dict[str, Any]) -> None:
    """What the read commands answered while the run trained (past its second checkpoint)."""
    assert [r["id"] for r in cli["runs"]] == [RUN]
    assert (cli["status"]["run"], cli["status"]["ranks"]) == (RUN, 2)
    assert [s["run"] for s in cli["all"]] == [RUN]
    assert cli["incidents"] == []
    (pool,) = cli["spares"]["runs"]
    assert (pool["active_nodes"], [s["name"] for s in pool["spares"]], pool["spares"][0]["health"]) == (
        2,
        ["node-2"],
        "healthy",
    )
    cadence = cli["cadence"]
    config = ControllerConfig()  # two_nodes' spare window and risk are the defaults
    implied = implied_pool(2, cadence["node_mtbf_h"], config.spare_window_h, config.spare_risk)
    assert pool["recommended"] == implied
    assert "node MTBF" in pool["why"]
    committed = [c for c in cli["checkpoints"]["checkpoints"] if c["state"] == "committed"]
    steps = [c["step"] for c in committed]
    assert len(steps) >= 2
    assert steps == sorted(steps, reverse=True)
    assert all(c["bytes"] > 0 and c["time_unix_s"] > 0 and c["blocking_s"] >= 0 for c in committed)
    assert cadence["mtbf_s"] > 0
    assert cadence["step_s"] > 0
    assert cadence["why"]
    assert cli["cordon"] == (0, "node-2: cordoned")
    assert cli["uncordon"] == (0, "node-2: spare")


def test_a_collective_timeout_names_the_rank_its_peers_wait_for(tmp_path: Path) -> None:
    """Rank 0 is stopped (SIGSTOP); rank 1 waits for it in a collective and, after 2 s, says so. The controller
    names rank 0 (the rank that does not wait) long before the hang timeout (60 s here), and recovers."""
    config, spec = two_nodes(tmp_path, "--opsd-collective-timeout-s", "2", hang_floor_s=60.0)
    stop = threading.Event()
    stopped_at: dict[str, float] = {}

    def on_poll(controller: Controller, backend: LocalBackend, now_s: float) -> None:
        status = controller.status(RUN, now_s)
        assert status is not None
        if "hang" not in stopped_at and status.step >= 20:
            inject(backend, FaultKind.HANG, rank=0)
            stopped_at["hang"] = now_s
        if (
            any(i.state == "recovered" for i in controller.store.incidents(RUN))
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


def test_a_cadence_republished_often_never_makes_ranks_disagree(tmp_path: Path) -> None:
    """The controller republishes the cadence whenever K moves at all (``change_ratio`` 0), 5 s ahead (``lead_s``:
    more than a telemetry interval for the newest step to be heard, another for the policy to reach each node, and
    the rank's second between looks at its file; with 2 s, a rank could reach the new cadence's first step before
    it had read it): on 2 nodes x 1 rank (saving every 20 steps of their own) that is a new cadence every few
    seconds, each node's file changing at its own heartbeat. Each new cadence keeps the one in force as
    ``previous``, so that the ranks decide every step alike whichever file they read: a rank that saved while its
    peer did not would wait for it in the save's collective, and the controller would see a hang."""
    config, spec = two_nodes(tmp_path, hang_floor_s=8.0)
    cadence = CadenceConfig(lead_s=5.0, change_ratio=0.0, min_interval_s=1.0)
    config = replace(config, controller=replace(config.controller, cadence=cadence))
    stop = threading.Event()
    seen: dict[tuple[int, int], int] = {}  # each cadence published: the step when it was first seen
    steps: list[int] = []
    problem: list[str] = []
    first_poll_s: list[float] = []

    def on_poll(controller: Controller, backend: LocalBackend, now_s: float) -> None:
        first_poll_s[:] = first_poll_s or [now_s]
        status = controller.status(RUN, now_s)
        assert status is not None
        if status.cadence is not None:
            seen.setdefault((status.cadence.every_steps, status.cadence.from_step), status.step)
            steps.append(status.step)
        if controller.store.incidents(RUN) or (seen and steps[-1] - min(seen.values()) >= REPUBLISHED_STEPS):
            stop.set()
        elif now_s - first_poll_s[0] > 2 * PHASE_LIMIT_S:  # a deadline, not a duration: the steps end it
            problem.append(f"{REPUBLISHED_STEPS} steps under new cadences not trained in {2 * PHASE_LIMIT_S:g} s")
            stop.set()

    status = run_local(config, spec, on_poll=on_poll, stop=stop, timeout_s=300)
    assert not problem, (problem, seen, steps[-1:])
    assert status["incidents"] == [], status["incidents"]
    assert len(seen) >= 4, seen  # republished again and again
    passed = [start for _, start in seen if start < steps[-1]]
    assert len(passed) >= 3, (seen, steps[-1])  # and the ranks went past each one's first step
