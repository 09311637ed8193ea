"""Maintenance windows (``opsd maintenance``): while one holds a run, or every run, a failure is still detected and
recorded, and nothing is done about it; when the window ends, its recovery starts. Through the controller with the
in-memory backend, and through the API (with the reader's and the operator's tokens) into the status and /metrics."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from opsd.api.app import create_app
from opsd.api.auth import Credentials
from opsd.controller.holds import EVERY_RUN, Holds
from opsd.controller.state import StateStore
from opsd.protocol.answers import Maintenance
from tests.test_dry_run import controller_of, fail

TOKEN, READER = "operator-token", "reader-token"


def test_a_window_holds_the_recovery_and_its_end_starts_it(tmp_path: Path) -> None:
    controller, backend = controller_of(tmp_path, dry_run=False)
    controller.holds.start(None, "switch firmware", 1.0)  # every run
    fail(controller)
    (incident,) = controller.store.incidents("job")
    assert (incident.kind, incident.state) == ("fatal_xid", "open")  # recorded
    assert backend.calls == []  # and held: nothing asked of the cluster
    run = controller.store.run("job")
    assert run is not None
    assert run.state == "running"
    status = controller.status("job", 6.0)
    assert status is not None
    assert status.maintenance == Maintenance(every_run=True, reason="switch firmware", since_s=1.0)
    controller.tick(6.5)
    assert backend.calls == []  # still held
    assert controller.holds.stop(None)
    controller.tick(7.0)  # the next pass starts the recovery held
    assert {"quarantine_node", "promote_spare", "stop_ranks", "relaunch"} <= {c.step for c in backend.calls}
    status = controller.status("job", 7.0)
    assert status is not None
    assert status.maintenance is None


def test_a_runs_window_or_the_one_over_every_run_holds_it(tmp_path: Path) -> None:
    holds = Holds(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}").engine)
    assert holds.of("a") is None
    first = holds.start("a", "disk swap", 10.0)
    assert holds.start("a", "disk swap, longer", 20.0).since_s == first.since_s == 10.0  # one window, reason updated
    assert holds.of("a") is not None
    assert holds.of("b") is None
    holds.start(None, "everything", 30.0)
    assert [h.scope for h in holds.all()] == [EVERY_RUN, "a"]
    hold_b = holds.of("b")
    assert hold_b is not None
    assert hold_b.run is None
    assert holds.stop("a")
    assert not holds.stop("a")
    assert holds.stop(None)
    assert holds.all() == []


def test_the_api_starts_and_stops_a_window_for_operators_only(tmp_path: Path) -> None:
    controller, _ = controller_of(tmp_path, dry_run=False)
    credentials = Credentials(operator=TOKEN, reader=READER)
    app = create_app(controller, credentials, clock=lambda: 100.0)
    with TestClient(app) as c:
        as_reader = {"Authorization": f"Bearer {READER}"}
        as_operator = {"Authorization": f"Bearer {TOKEN}"}
        assert c.post("/v1/maintenance/start", json={"run": "job"}, headers=as_reader).status_code == 403
        started = c.post("/v1/maintenance/start", json={"run": "job", "reason": "rack work"}, headers=as_operator)
        assert started.status_code == 200, started.text
        assert started.json() == {"run": "job", "reason": "rack work", "since_s": 100.0}
        assert c.post("/v1/maintenance/start", json={"reason": ""}, headers=as_operator).status_code == 422
        assert c.get("/v1/maintenance", headers=as_reader).json() == [started.json()]
        status = c.get("/v1/runs/job", headers=as_reader).json()
        assert status["maintenance"] == {"every_run": False, "reason": "rack work", "since_s": 100.0}
        metrics = c.get("/metrics", headers=as_reader).text
        assert 'opsd_run_maintenance{run="job"} 1.0' in metrics
        stopped = c.post("/v1/maintenance/stop", json={"run": "job"}, headers=as_operator).json()
        assert stopped == {"run": "job", "ended": True}
        again = c.post("/v1/maintenance/stop", json={"run": "job"}, headers=as_operator).json()
        assert again == {"run": "job", "ended": False}
        assert 'opsd_run_maintenance{run="job"} 0.0' in c.get("/metrics", headers=as_reader).text
