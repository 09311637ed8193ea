"""A controller in dry run (``controller.dry_run``, ``opsd serve --dry-run``) detects and decides as it would,
records the incident and every step of the plan, and takes none: the backend is never called, the run goes on, and
no later controller carries the steps out. The same failure without dry run is recovered from (the control)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from opsd.backends.fake import FakeBackend
from opsd.cli.app import app
from opsd.controller.controller import Controller
from opsd.controller.incidents import unfinished_incident
from opsd.controller.rows import RunSpec
from opsd.controller.state import StateStore
from opsd.protocol.states import NodeRole
from tests.test_controller import CONFIG, beat, rank

XID = {"seq": 1, "gpu": 0, "xid": 79, "time_s": 5.0, "action": "cordon_and_swap", "reason": "fallen off the bus"}


def controller_of(tmp_path: Path, dry_run: bool) -> tuple[Controller, FakeBackend]:
    backend = FakeBackend(["n0", "n1", "n2"], gpus_per_node=2)
    store = StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}")
    store.create_run("job", RunSpec(backend="fake"), 0.0)
    for node in ("n0", "n1"):
        store.upsert_node(node, 0.0, run="job", role=NodeRole.ACTIVE)
    store.upsert_node("n2", 0.0, run="job", role=NodeRole.SPARE)
    controller = Controller(store, replace(CONFIG, dry_run=dry_run), backend)
    controller.recovery.threaded = False
    controller.recovery.launch_first("job", 0.0)
    backend.calls.clear()  # what the failure asks of the cluster, from here
    return controller, backend


def fail(controller: Controller) -> None:
    for t in range(5):
        controller.heartbeat(beat("n0", [rank(0, t + 1), rank(1, t + 1)]), float(t))
        controller.heartbeat(beat("n1", [rank(2, t + 1), rank(3, t + 1)]), float(t))
        controller.tick(float(t))
    controller.heartbeat(beat("n1", [rank(2, 6), rank(3, 6)], [XID]), 5.2)
    controller.tick(5.3)
    controller.tick(5.8)  # seen again: the same incident


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry run", "control"])
def test_a_dry_run_records_the_plan_and_takes_no_step(tmp_path: Path, dry_run: bool) -> None:
    controller, backend = controller_of(tmp_path, dry_run)
    fail(controller)
    (incident,) = controller.store.incidents("job")
    actions = controller.store.actions(incident_id=incident.id)
    kinds = [a.kind for a in actions]
    assert kinds == ["cordon", "take_spare", "stop", "launch"]  # a swap's plan (opsd.policy.recovery)
    run = controller.store.run("job")
    assert run is not None
    if dry_run:
        assert incident.state == "dry_run"
        assert {a.state for a in actions} == {"not_taken"}
        assert backend.calls == []  # nothing asked of the cluster
        assert run.state == "running"
        assert {n.name: n.role for n in controller.store.nodes("job")} == {
            "n0": "active",
            "n1": "active",
            "n2": "spare",
        }
        assert unfinished_incident(controller.store, "job") is None  # nothing for a later controller to go on with
    else:
        assert incident.state == "open"
        assert {"quarantine_node", "promote_spare", "stop_ranks", "relaunch"} <= {c.step for c in backend.calls}


def test_serve_offers_dry_run() -> None:
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "--dry-run" in result.output
