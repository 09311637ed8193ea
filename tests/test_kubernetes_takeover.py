"""A leader that takes over a recovery closes it whatever the timing: the orderings that left an incident open,
played one step at a time on the emulated cluster (no rank process; the heartbeats, the pods' exits and the
controllers' passes come in the order each test gives, so the machine's speed decides nothing).

The leader dies just after it evicted the pods. The JobSet restarts them on node-0 and the spare node-2, and the
new launch's ranks train on: their agents send what they remember of them to whichever replica leads. The
successor leads only once the Lease runs out, and by then the new pods may have run to their end (few steps were
left after the checkpoint). It must record the restart that happened, take the new launch's reports (they say which
launch they belong to: ``OPSD_LAUNCH``, the pod's restart attempt) however long ago they were sent, and close the
incident with where the ranks resumed.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from opsd.backends.kubernetes.api import KubeApi
from opsd.backends.kubernetes.backend import KubernetesBackend
from opsd.backends.kubernetes.leader import KubernetesController
from opsd.controller.config import ControllerConfig
from opsd.controller.controller import Controller
from opsd.controller.rows import RunSpec
from opsd.controller.state import StateStore
from opsd.policy.detection import Failure, FailureKind
from opsd.protocol.heartbeat import Heartbeat, HeartbeatRank
from opsd.protocol.states import IncidentState, RunState
from tests.backend_contract import SimulatedCrashError, crash_at
from tests.kube.emulator import KubeEmulator
from tests.kube.machines import JOBSETS, NAMESPACE, KubeMachines
from tests.waiting import wait_for

RUN = "job"
XID = Failure(FailureKind.FATAL_XID, "node-1", None, "XID 79 on GPU 0: fallen off the bus")
CONFIG = ControllerConfig(step_timeout_s=5.0, step_retry_max_s=0.1)


class ScriptedKubelet:
    """Pods run until the test says they exited."""

    def __init__(self) -> None:
        self.exits: dict[str, int] = {}

    def start(self, pod: dict[str, Any], node: str, index: int, attempt: int) -> None:
        pass

    def exit_code(self, pod: dict[str, Any]) -> int | None:
        return self.exits.get(pod["metadata"]["name"])

    def stop(self, pod: dict[str, Any]) -> None:
        pass


def beat(c: Controller, placed: dict[int, str], step: int, reported_s: float, now_s: float, **extra: Any) -> None:
    """Each node's agent sends what it remembers of its rank: its last report, received at ``reported_s``."""
    for rank, node in placed.items():
        r = HeartbeatRank(run=RUN, rank=rank, step=step, step_s=0.1, last_report_unix_s=reported_s, **extra)
        c.heartbeat(Heartbeat(v=1, node=node, time_unix_s=now_s, ranks=[r]), now_s)


def leader_died_after_the_evictions(kube: KubeEmulator, store: StateStore) -> tuple[KubeMachines, ScriptedKubelet]:
    """The first leader: launch 0 reported step 25, an XID on node-1, the leader killed once its stop is done."""
    kubelet = ScriptedKubelet()
    machines = KubeMachines(kube, RUN, kubelet=kubelet, grace_s=0)
    first = Controller(store, CONFIG, machines.backend)
    first.recovery.threaded = False
    machines.set_up(first, nodes=2, spares=1)
    t = time.time()
    beat(first, {0: "node-0", 1: "node-1"}, 25, t, t, launch=0)
    first.tick(t)  # the run's newest step (25) recorded
    first.recovery.on_step = crash_at("completed", 2)  # the stop (seq 2) recorded done, then the leader dies
    run = store.run(RUN)
    assert run is not None
    with pytest.raises(SimulatedCrashError):
        first.open_failure(run, [XID], t)
    machines.clusters[-1].close()
    wait_for("new pods on node-0 and node-2", lambda: machines.placement() == {0: "node-0", 1: "node-2"}, 20)
    return machines, kubelet


def successor(machines: KubeMachines, store: StateStore) -> tuple[Controller, KubernetesController]:
    backend = KubernetesBackend(KubeApi(machines.kube.api_client), machines.config)
    controller = Controller(store, CONFIG, backend)
    controller.recovery.threaded = False
    leader = KubernetesController(controller, backend.api, machines.config, tick_interval_s=0.25)
    for informer in (leader.nodes, leader.pods, leader.jobsets):
        informer.start()
    for informer in (leader.nodes, leader.pods, leader.jobsets):
        assert informer.synced.wait(10), informer.kind
    return controller, leader


def completed(machines: KubeMachines) -> bool:
    found = machines.kube.get(JOBSETS, NAMESPACE, RUN) or {}
    return any(c["type"] == "Completed" for c in (found.get("status") or {}).get("conditions") or [])


def check_recovered(store: StateStore, incident_id: int) -> None:
    incident = store.incident(incident_id)
    assert incident is not None
    assert (incident.state, incident.spare) == (IncidentState.RECOVERED, "node-2")
    assert (incident.resumed_from_step, incident.lost_steps) == (20, 5)  # the new launch's reports said 20
    kinds = [(a.kind, a.state) for a in store.actions(incident_id=incident_id)]
    assert kinds == [("cordon", "done"), ("take_spare", "done"), ("stop", "done"), ("launch", "done")]


def test_the_new_pods_ran_to_their_end_before_the_successor_led(kube: KubeEmulator, store: StateStore) -> None:
    machines, kubelet = leader_died_after_the_evictions(kube, store)
    try:
        ended_s = time.time()
        for pod in kube.objects("pods", NAMESPACE):
            if pod["metadata"]["labels"]["jobset.sigs.k8s.io/restart-attempt"] == "1":
                kubelet.exits[pod["metadata"]["name"]] = 0
        wait_for("completion of the JobSet", lambda: completed(machines), 20)

        controller, leader = successor(machines, store)
        try:
            now = time.time()
            new_launch = {0: "node-0", 1: "node-2"}
            beat(controller, new_launch, 60, ended_s, now, launch=1, resumed_from_step=20)  # before it takes up
            leader.reconciler.sync(now)
            leader.take_up(now)
            beat(controller, new_launch, 60, ended_s, now + 1, launch=1, resumed_from_step=20)  # resent
            controller.tick(now + 1)
        finally:
            leader.close()
        (incident,) = store.incidents(RUN)
        check_recovered(store, int(incident.id))
        run = store.run(RUN)
        assert run is not None
        assert (run.state, run.generation, run.final_step) == (RunState.COMPLETED, 2, 60)
    finally:
        machines.player.stop()


def test_the_new_launch_reported_before_the_successor_confirmed_it(kube: KubeEmulator, store: StateStore) -> None:
    """The new pods train on while the successor verifies the restart: their reports, sent before it confirmed the
    launch, are the new launch's (they say so); the old launch's, sent later by an agent that remembers them, are
    not."""
    machines, _ = leader_died_after_the_evictions(kube, store)
    try:
        controller, leader = successor(machines, store)
        try:
            before = time.time()
            leader.reconciler.sync(before)
            beat(controller, {0: "node-0", 1: "node-2"}, 31, before, before, launch=1, resumed_from_step=20)
            leader.take_up(before)
            later = time.time() + 1
            beat(controller, {1: "node-1"}, 25, later, later, launch=0)  # node-1's agent still remembers rank 1
            beat(controller, {0: "node-0", 1: "node-2"}, 31, before, later, launch=1, resumed_from_step=20)
            controller.tick(later)
            status = controller.status(RUN, later)
        finally:
            leader.close()
        (incident,) = store.incidents(RUN)
        check_recovered(store, int(incident.id))
        assert status is not None
        assert (status.state, status.step, status.generation) == ("running", 31, 2)
        assert controller.rank_node(RUN, 1) == "node-2"
    finally:
        machines.player.stop()


def test_a_run_that_ends_between_a_report_and_a_pass_has_its_incident_closed(store: StateStore) -> None:
    """The relaunch's ranks reported, and the run was marked completed (its JobSet finished) before any detection
    pass saw them progress."""
    store.create_run(RUN, RunSpec(backend="kubernetes"), 0.0)
    store.update_run(RUN, 0.0, generation=1, last_step=25)
    incident, _ = store.open_incident(
        key=f"{RUN}/gen1",
        run=RUN,
        kind="fatal_xid",
        node="node-1",
        rank=None,
        detail="XID 79",
        failed_s=1.0,
        detected_s=2.0,
    )
    c = Controller(store, CONFIG)
    c.forget_ranks(RUN, 3.0)
    store.update_run(RUN, 3.0, generation=2)
    c.launched(RUN, 4.0, launch=1)
    beat(c, {0: "node-0", 1: "node-2"}, 60, 9.0, 10.0, launch=1, resumed_from_step=20)
    store.update_run(RUN, 10.5, state=RunState.COMPLETED, final_step=c.final_step(RUN))

    c.tick(11.0)

    found = store.incident(incident)
    assert found is not None
    assert (found.state, found.resumed_from_step, found.lost_steps) == ("recovered", 20, 5)
