"""Recoveries that outlive their controller or their spares, for real (`opsd run`, agents, the reference trainer on
2 nodes x 1 rank):

- the controller is SIGKILLed in the middle of a swap (after the cordon, before the spare is taken and the ranks
  stopped) and started
  again: it kills what the dead one left running, finishes the recovery without repeating an action, and the run
  completes with one incident in its history;
- no spare left: the run waits, and goes on once the failed node is uncordoned;
- no spare left, shrinking allowed: the run goes on with one node (``--mesh dp_shard=-1`` fits the smaller world).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from opsd.backends.local.backend import LocalBackend
from opsd.backends.local.processes import free_port
from opsd.checkpoints.layout import inspect_checkpoints
from opsd.checkpoints.store import open_store
from opsd.cli.client import HttpClient
from opsd.cli.demo_run import checkpoint_url, run_spec, serve_config
from opsd.controller.controller import Controller
from opsd.controller.port import FaultKind
from opsd.controller.state import StateStore
from opsd.runtime.local import run_local
from tests.faults import inject
from tests.launch import ROOT
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

STEPS = 60
INJECT = (sys.executable, "-m", "opsd", "inject", "xid", "--node", "node-1", "--gpu", "0", "--xid", "79")


def trainer(ckpt: str, mesh: str = "dp_shard=2") -> list[str]:
    return [
        sys.executable,
        "-m",
        "examples.train",
        "--mesh",
        mesh,
        "--steps",
        str(STEPS),
        "--opsd-monitor",
        "--ckpt-dir",
        ckpt,
        "--ckpt-every",
        "10",
        "--resume",
    ]


def past_a_checkpoint(ckpt: str, step: int) -> bool:
    """A checkpoint is committed and training is at least 3 steps past it."""
    committed = [c.step for c in inspect_checkpoints(open_store(ckpt)) if c.problem is None]
    return bool(committed) and step >= max(committed) + 3


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_a_controller_killed_mid_recovery_finishes_it_once_when_started_again(tmp_path: Path) -> None:
    state, ckpt, port = tmp_path / "state", f"file://{tmp_path / 'ckpt'}", free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable,
        "-m",
        "opsd",
        "run",
        "--run",
        "job",
        "--nodes",
        "2",
        "--gpus-per-node",
        "1",
        "--spares",
        "1",
        "--port",
        str(port),
        "--state-dir",
        str(state),
        "--checkpoint-url",
        ckpt,
        "--log-level",
        "WARNING",
    ]
    log = tmp_path / "first.log"

    def tail() -> str:
        return log.read_text()[-3000:]

    with log.open("w") as out:
        first = subprocess.Popen(
            [*command, "--crash-after-action", "cordon", "--", *trainer(ckpt)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        wait_for("token", (state / "token").exists, 30, alive=first, context=tail, interval_s=0.2)
        client = HttpClient(url, None, str(state))

        def progressed() -> bool:
            try:
                step = int(client.get("/v1/runs/job")["step"])
            except Exception:
                return False
            return past_a_checkpoint(ckpt, step)

        wait_for("checkpoint", progressed, 120, alive=first, context=tail, interval_s=0.2)
        inject = subprocess.run(
            [*INJECT, "--url", url, "--state-dir", str(state), "--run", "job"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert inject.returncode == 0, inject.stderr
        assert first.wait(timeout=60) == -9, tail()  # killed itself after the cordon
    finally:
        if first.poll() is None:
            first.kill()

    store = StateStore.open(f"sqlite:///{state / 'opsd.db'}")
    (incident,) = store.incidents("job")
    assert (incident.kind, incident.state, incident.node) == ("fatal_xid", "open", "node-1")
    assert [(a.kind, a.state) for a in store.actions(incident_id=incident.id)] == [("cordon", "done")]
    left = json.loads((state / "runs" / "job" / "processes.json").read_text())
    orphans = [pid for pid, _ in left["agents"].values()]
    assert all(alive(pid) for pid in orphans)  # the dead controller's agents run on

    second = subprocess.run([*command, "--", *trainer(ckpt)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-4000:]
    assert json.loads(second.stdout.strip().splitlines()[-1])["state"] == "completed"
    assert not any(alive(pid) for pid in orphans)

    run = store.run("job")
    assert run is not None
    assert (run.state, run.final_step, run.generation) == ("completed", STEPS, 2)  # relaunched once
    (incident,) = [i for i in store.incidents("job") if i.kind != "straggler"]  # once in the history
    assert (incident.kind, incident.state, incident.spare) == ("fatal_xid", "recovered", "node-2")
    actions = store.actions(incident_id=incident.id)
    assert [(a.kind, a.state) for a in actions] == [
        ("cordon", "done"),
        ("take_spare", "done"),
        ("stop", "done"),
        ("launch", "done"),
    ]
    assert actions[1].result == {"spare": "node-2"}
    assert actions[3].result is not None
    assert (actions[3].result["generation"], actions[3].result["nodes"]) == (2, ["node-0", "node-2"])
    assert {n.name: n.role for n in store.nodes("job")} == {
        "node-0": "active",
        "node-1": "cordoned",
        "node-2": "active",
    }


def local_run(tmp_path: Path, on_poll: Any, **spec: Any) -> dict[str, Any]:
    config = serve_config(tmp_path, heartbeat_floor_s=3.0)
    command = trainer(checkpoint_url(tmp_path), spec.pop("mesh", "dp_shard=2"))
    return run_local(
        config,
        run_spec("job", config, tmp_path, command, gpus_per_node=1, spares=0, **spec),
        on_poll=on_poll,
        timeout_s=240,
    )


class XidOnce:
    """Injects an XID 79 on node-1 once training is past a committed checkpoint."""

    def __init__(self, tmp_path: Path) -> None:
        self.ckpt = f"file://{tmp_path / 'ckpt'}"
        self.injected = False

    def __call__(self, controller: Controller, backend: LocalBackend, now_s: float) -> None:
        status = controller.status("job", now_s)
        if not self.injected and status is not None and past_a_checkpoint(self.ckpt, status.step):
            inject(backend, FaultKind.XID, node="node-1", gpu=0, xid=79)
            self.injected = True


def test_without_a_spare_the_run_waits_until_a_node_is_uncordoned(tmp_path: Path) -> None:
    xid = XidOnce(tmp_path)
    waited: list[float] = []

    def on_poll(controller: Controller, backend: LocalBackend, now_s: float) -> None:
        xid(controller, backend, now_s)
        run = controller.store.run("job")
        if run is not None and run.state == "waiting_for_spare":
            waited.append(now_s)
            if len(waited) == 8:  # two seconds of waiting: the operator puts node-1 back
                url = backend.spec.controller_url.removesuffix("/v1/heartbeat")
                HttpClient(url, None, str(tmp_path / "state")).post("/v1/nodes/node-1/uncordon", {})

    status = local_run(tmp_path, on_poll)
    assert (status["state"], status["step"]) == ("completed", STEPS)
    assert len(waited) >= 8  # it did wait
    (incident,) = [i for i in status["incidents"] if i["kind"] != "straggler"]
    assert (incident["kind"], incident["state"], incident["spare"]) == ("fatal_xid", "recovered", "node-1")
    assert incident["resumed_s"] > waited[-1]


def test_without_a_spare_the_run_may_shrink(tmp_path: Path) -> None:
    status = local_run(tmp_path, XidOnce(tmp_path), mesh="dp_shard=-1", on_no_spare="shrink")
    assert (status["state"], status["step"]) == ("completed", STEPS)
    (incident,) = [i for i in status["incidents"] if i["kind"] != "straggler"]
    assert (incident["kind"], incident["state"], incident["spare"]) == ("fatal_xid", "recovered", None)
    assert incident["resumed_from_step"] >= 10
    assert [n["role"] for n in status["nodes"]] == ["active", "cordoned"]
