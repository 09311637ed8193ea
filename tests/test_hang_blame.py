"""A hang is blamed on the node the Flight Recorder names: the detection pass's first guess (the rank furthest
behind) gives way to the dumps' culprit in the incident, kept in its detail and in the dump step's result; a node
blamed for ``hang_quarantine_after`` hangs within ``hang_window_h`` is swapped for a spare like a failed one.

The recoveries run through the executor on the in-memory backend; the dumps are what a stopped rank leaves: its
peer dumps, it sends none."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from opsd.backends.fake import FakeBackend
from opsd.controller.config import ControllerConfig
from opsd.controller.controller import Controller
from opsd.controller.rows import RunSpec
from opsd.controller.state import Action, StateStore
from opsd.policy.detection import Failure, FailureKind
from opsd.protocol.heartbeat import Heartbeat, HeartbeatRank
from opsd.protocol.states import ActionKind, NodeRole

RUN = "job"
NODES = {0: "node-0", 1: "node-1"}  # rank -> node


def controller(tmp_path: Path, **config: float) -> Controller:
    c = Controller(
        StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"),
        ControllerConfig(flight_wait_s=0.5, **config),  # type: ignore[arg-type]
        FakeBackend(gpus_per_node=1),
    )
    c.recovery.threaded = False
    backend = c.backend
    assert isinstance(backend, FakeBackend)
    backend.nodes = dict.fromkeys(["node-0", "node-1", "node-2"], "ready")
    now = time.time()
    c.store.create_run(RUN, RunSpec(backend="fake"), now)
    for node in ("node-0", "node-1"):
        c.store.upsert_node(node, now, run=RUN, role=NodeRole.ACTIVE)
    c.store.upsert_node("node-2", now, run=RUN, role=NodeRole.SPARE)
    c.recovery.launch_first(RUN, now)
    c.recovery.on_step = peer_dumps(c)
    return c


def report(c: Controller) -> None:
    """The ranks' heartbeats: rank 0 on node-0, rank 1 on node-1."""
    now = time.time()
    for rank, node in NODES.items():
        ranks = [HeartbeatRank(run=RUN, rank=rank, step=10, step_s=0.1, last_report_unix_s=now)]
        c.heartbeat(Heartbeat(v=1, node=node, time_unix_s=now, ranks=ranks), now)


def peer_dumps(c: Controller):  # type: ignore[no-untyped-def]
    """When a dump step is recorded, rank 1 dumps (it waits on nothing it can name); rank 0, stopped, sends none."""

    def on_step(point: str, action: Action) -> None:
        if point == "recorded" and action.kind == ActionKind.DUMP:
            body = json.dumps({"run": RUN, "rank": 1, "world_size": 2, "trace": {}, "groups": {}})
            trigger = str(action.args["trigger"])
            c.store.add_flight_dump(
                run=RUN, trigger=trigger, rank=1, incident_id=action.incident_id, received_s=time.time(), body=body
            )

    return on_step


def hang(c: Controller) -> int:
    """A hang the detection pass blames on rank 1 (furthest behind), on node-1."""
    report(c)
    run = c.store.run(RUN)
    assert run is not None
    failure = Failure(FailureKind.HANG, "node-1", 1, "no step progress for 12.0 s; furthest behind: rank 1")
    return c.open_failure(run, [failure], time.time())


def test_the_dumps_culprit_becomes_the_incidents_and_a_second_hang_swaps_its_node(tmp_path: Path) -> None:
    c = controller(tmp_path)
    first = hang(c)

    incident = c.store.incident(first)
    assert incident is not None
    assert (incident.node, incident.rank) == ("node-0", 0)
    assert "the Flight Recorder names rank 0 on node-0" in incident.detail
    assert "first blamed: rank 1 on node-1" in incident.detail
    kinds = [a.kind for a in c.store.actions(incident_id=first)]
    assert kinds == ["dump", "stop", "launch"]  # one hang: a warning, no swap
    (dump,) = [a for a in c.store.actions(incident_id=first) if a.kind == "dump"]
    assert dump.result is not None
    assert dump.result["culprit"] == {"rank": 0, "node": "node-0", "first_blamed": {"rank": 1, "node": "node-1"}}
    assert dump.result["strikes"] == 1

    second = hang(c)

    actions = c.store.actions(incident_id=second)
    assert [(a.kind, a.args.get("node") or a.args.get("for")) for a in actions] == [
        ("dump", None),
        ("cordon", "node-0"),
        ("take_spare", "node-0"),
        ("stop", None),
        ("launch", None),
    ]
    assert "hung 2 times within 24 h" in str(actions[1].args["reason"])
    roles = {n.name: n.role for n in c.store.nodes(RUN)}
    assert roles == {"node-0": NodeRole.CORDONED, "node-1": NodeRole.ACTIVE, "node-2": NodeRole.ACTIVE}
    backend = c.backend
    assert isinstance(backend, FakeBackend)
    assert backend.nodes["node-0"] == "quarantined"


@pytest.mark.parametrize("threshold", [0, 3])
def test_below_the_threshold_or_with_none_a_hang_swaps_nothing(tmp_path: Path, threshold: int) -> None:
    c = controller(tmp_path, hang_quarantine_after=threshold)
    hang(c)
    second = hang(c)
    assert [a.kind for a in c.store.actions(incident_id=second)] == ["dump", "stop", "launch"]
    assert {n.role for n in c.store.nodes(RUN) if n.name != "node-2"} == {NodeRole.ACTIVE}


def test_a_controller_that_takes_the_recovery_up_after_the_dump_makes_the_same_plan(tmp_path: Path) -> None:
    """The plan after a dump is made from the dump step's recorded result: a successor goes on with the swap."""
    c = controller(tmp_path)
    hang(c)

    class Died(BaseException):
        pass

    def die_after_the_dump(point: str, action: Action) -> None:
        peer_dumps(c)(point, action)
        if point == "completed" and action.kind == ActionKind.DUMP:
            raise Died

    c.recovery.on_step = die_after_the_dump
    with pytest.raises(Died):
        hang(c)
    successor = Controller(c.store, c.config, c.backend)
    successor.recovery.threaded = False
    run = c.store.run(RUN)
    assert run is not None
    incident = successor.recovery.take_up(run, time.time(), "the controller died")
    kinds = [a.kind for a in c.store.actions(incident_id=incident)]
    assert kinds == ["dump", "cordon", "take_spare", "stop", "launch"]
    assert all(a.state == "done" for a in c.store.actions(incident_id=incident))
