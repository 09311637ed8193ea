"""A drill (``opsd drill xid``): an operator rehearses a fatal XID on a real cluster, where no GPU fault can be made;
opsd recovers from it as from a real XID (the same plan, carried out by the backend), and its record says "drill".
Through the controller with the in-memory backend, and through the API and the CLI (operators only)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from opsd.api.app import create_app
from opsd.api.auth import Credentials
from opsd.controller.controller import Controller
from opsd.errors import NotFoundError, PermanentError
from tests.test_controller import beat, rank
from tests.test_dry_run import controller_of

TOKEN, READER = "operator-token", "reader-token"


def training(controller: Controller) -> None:
    for t in range(3):
        controller.heartbeat(beat("n0", [rank(0, t + 1), rank(1, t + 1)]), float(t))
        controller.heartbeat(beat("n1", [rank(2, t + 1), rank(3, t + 1)]), float(t))
        controller.tick(float(t))


@pytest.mark.parametrize("dry_run", [False, True], ids=["carried out", "dry run"])
def test_a_drilled_xid_is_recovered_from_as_a_real_one_and_says_drill(tmp_path: Path, dry_run: bool) -> None:
    controller, backend = controller_of(tmp_path, dry_run=dry_run)
    training(controller)
    incident = controller.drill_xid("job", "n1", 3, 79, 3.5)
    assert (incident.kind, incident.node) == ("fatal_xid", "n1")
    assert incident.detail.startswith("drill: XID 79 on GPU 3")
    actions = [a.kind for a in controller.store.actions(incident_id=incident.id)]
    assert actions == ["cordon", "take_spare", "stop", "launch"]  # a real XID's plan
    if dry_run:
        assert backend.calls == []
        assert controller.store.incident(incident.id).state == "dry_run"  # type: ignore[union-attr]
    else:
        assert {"quarantine_node", "promote_spare", "stop_ranks", "relaunch"} <= {c.step for c in backend.calls}
        assert {n.name: n.role for n in controller.store.nodes("job")}["n1"] == "cordoned"


def test_a_drill_is_refused_where_it_cannot_be_carried_out(tmp_path: Path) -> None:
    controller, _ = controller_of(tmp_path, dry_run=False)
    training(controller)
    with pytest.raises(NotFoundError, match="no run"):
        controller.drill_xid("nope", "n1", 0, 79, 3.5)
    with pytest.raises(PermanentError, match=r"'n2' is not one of run 'job''s active nodes \(n0, n1\)"):
        controller.drill_xid("job", "n2", 0, 79, 3.5)  # the spare
    controller.drill_xid("job", "n1", 0, 79, 3.5)  # recovered from at once here: n2 took n1's place
    with pytest.raises(PermanentError, match=r"'n1' is not one of run 'job''s active nodes \(n0, n2\)"):
        controller.drill_xid("job", "n1", 0, 79, 3.6)  # quarantined


def test_the_api_drills_for_operators_only(tmp_path: Path) -> None:
    controller, backend = controller_of(tmp_path, dry_run=False)
    training(controller)
    app = create_app(controller, Credentials(operator=TOKEN, reader=READER), clock=lambda: 4.0)
    with TestClient(app) as c:
        body = {"node": "n0", "gpu": 1}
        assert c.post("/v1/runs/job/drill", json=body, headers={"Authorization": f"Bearer {READER}"}).status_code == 403
        bad = c.post("/v1/runs/job/drill", json={"node": "n0", "xid": 0}, headers={"Authorization": f"Bearer {TOKEN}"})
        assert bad.status_code == 422
        answer = c.post("/v1/runs/job/drill", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
        assert answer.status_code == 200, answer.text
        assert (answer.json()["kind"], answer.json()["node"]) == ("fatal_xid", "n0")
        assert "drill" in answer.json()["detail"]
    assert backend.calls  # carried out
