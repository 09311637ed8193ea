"""The Kubernetes backend's steps on the emulated API server (tests.kube): what each does to nodes, pods and Events,
and how it meets a cluster that pushes back (a node changed meanwhile, a PodDisruptionBudget, a pod stuck
Terminating, a circuit breaker's limit); the reconciler that finds runs and node roles in the cluster, the leader's
label on its own pod, and the start-up check for JobSets. The informers it reads the cluster through are in
tests/test_kubernetes_informers.py; the port's contract for this backend is in tests/test_backend_contract.py."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from opsd.backends.kubernetes.api import Json, KubeApi
from opsd.backends.kubernetes.backend import KubernetesBackend
from opsd.backends.kubernetes.cluster import (
    CHECKPOINT_URL_ANNOTATION,
    CORDONED_BY_OPSD_ANNOTATION,
    JOBSET_GROUP,
    JOBSET_MIN_RELEASE,
    JOBSET_NAME_LABEL,
    JOBSET_PLURAL,
    JOBSET_VERSION,
    MIN_NODES_ANNOTATION,
    ON_NO_SPARE_ANNOTATION,
    POOL_LABEL,
    QUARANTINE_TAINT,
    RESTART_ATTEMPT_LABEL,
    ROLE_LABEL,
    RUN_LABEL,
    SPARE_TAINT,
    STATE_LABEL,
)
from opsd.backends.kubernetes.config import KubernetesConfig
from opsd.backends.kubernetes.events import REQUEST_ANNOTATION, Target, event_name
from opsd.backends.kubernetes.leader import label_self
from opsd.backends.kubernetes.refs import RunRef
from opsd.backends.kubernetes.watch import Informer
from opsd.controller.port import Done, ErrorKind, Failed, Fault, FaultKind, NodeWitness, Outcome, Pending
from opsd.controller.rows import RunSpec
from opsd.controller.state import StateStore
from opsd.errors import ConfigError
from opsd.policy.recovery import OnNoSpare
from opsd.protocol.states import NodeRole, RunState
from opsd.protocol.steps import DumpReady, Launched, NodeChanged, Stopped
from opsd.runtime.config import ServeConfig
from opsd.runtime.kubernetes import run_kubernetes
from tests.backend_contract import BY_NAME, RUN, play
from tests.kube.emulator import KubeEmulator, kube_emulator
from tests.kube.machines import JOBSETS, NAMESPACE, KubeMachines, jobset, listed_reconciler, node, relist
from tests.rows import stored

XID_REASON = "fatal_xid: XID 79 on GPU 0: fallen off the bus"
OTHER_TAINT = {"key": "nvidia.com/gpu-xid-error", "value": "true", "effect": "NoSchedule"}


def taints(kube: KubeEmulator, name: str) -> dict[str, Json]:
    found = kube.get("nodes", None, name) or {}
    return {t["key"]: t for t in (found.get("spec") or {}).get("taints") or []}


def events(kube: KubeEmulator, reason: str) -> list[Json]:
    return [e for e in kube.objects("events") if e.get("reason") == reason]


def puts(kube: KubeEmulator, name: str) -> int:
    return kube.count("PUT", f"/api/v1/nodes/{name}")


def pod(
    name: str, node_name: str, *, attempt: int = 0, phase: str = "Running", grace_s: int = 30, run: str = RUN
) -> Json:
    labels = {JOBSET_NAME_LABEL: run, RESTART_ATTEMPT_LABEL: str(attempt)}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels},
        "spec": {
            "nodeName": node_name,
            "terminationGracePeriodSeconds": grace_s,
            "containers": [{"name": "trainer", "image": "trainer:1"}],
        },
        "status": {"phase": phase},
    }


def failed(outcome: Outcome[object], kind: ErrorKind) -> Failed:
    assert isinstance(outcome, Failed), outcome
    assert outcome.kind is kind, outcome
    return outcome


def pending(outcome: Outcome[object]) -> Pending:
    assert isinstance(outcome, Pending), outcome
    return outcome


class Clock:
    def __init__(self) -> None:
        self.now_s = time.time()

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def cluster(kube: KubeEmulator) -> KubeEmulator:
    """A namespace, the run's JobSet and two of its nodes, a spare, and a node that is no GPU node."""
    kube.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    kube.put(node("node-0", run=RUN))
    kube.put(node("node-1", run=RUN))
    kube.put(node("node-2", spare=True))
    kube.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "cpu-0", "labels": {}}})
    kube.put(jobset(RUN, 2))
    return kube


def backend_on(kube: KubeEmulator, clock: Clock, **config: Any) -> KubernetesBackend:
    backend = KubernetesBackend(KubeApi(kube.api_client), KubernetesConfig(namespace="opsd", **config), clock)
    backend.runs[RUN] = RunRef(NAMESPACE, RUN)
    return backend


@pytest.fixture
def backend(cluster: KubeEmulator, clock: Clock) -> KubernetesBackend:
    return backend_on(cluster, clock)


# -- the second witness of a silent node ------------------------------------------------------------------------
def ready_node(name: str, status: str | None) -> Json:
    """A GPU node whose kubelet reports ``Ready`` = ``status`` (None: no condition yet)."""
    obj = node(name)
    obj["status"] = {"conditions": [{"type": "Ready", "status": status}] if status is not None else []}
    return obj


@pytest.mark.parametrize("cached", [False, True], ids=["read from the API", "from the leader's informer"])
def test_a_node_is_up_only_while_its_kubelet_says_ready(kube: KubeEmulator, clock: Clock, cached: bool) -> None:
    """``node_ready`` (the ``NodeWitness`` of opsd.controller.port): True for Ready, False for NotReady, Unknown (the
    kubelet stopped reporting), no condition or no such node."""
    for name, status in (("up", "True"), ("down", "False"), ("unknown", "Unknown"), ("new", None)):
        kube.put(ready_node(name, status))
    backend = backend_on(kube, clock)
    if cached:
        api = KubeApi(kube.api_client)
        backend.node_cache = Informer(api, "nodes", lambda: api.nodes(""), timeout_s=1)
        backend.node_cache.relist()
    answers = {name: backend.node_ready(name) for name in ("up", "down", "unknown", "new", "gone")}
    assert answers == {"up": True, "down": False, "unknown": False, "new": False, "gone": False}
    assert isinstance(backend, NodeWitness)


# -- quarantine, release, promote ---------------------------------------------------------------------------------
def test_quarantine_cordons_taints_and_labels_the_node_keeping_what_others_set(
    cluster: KubeEmulator, backend: KubernetesBackend
) -> None:
    found = cluster.get("nodes", None, "node-1")
    assert found is not None
    found["spec"]["taints"] = [OTHER_TAINT]
    found["metadata"]["labels"]["team.example/owner"] = "infra"
    cluster.put(found)

    outcome = backend.quarantine_node(RUN, "node-1", XID_REASON, "r-1")

    assert outcome == Done(NodeChanged(changed=True))
    after = cluster.get("nodes", None, "node-1")
    assert after is not None
    assert after["spec"]["unschedulable"] is True
    assert taints(cluster, "node-1") == {
        OTHER_TAINT["key"]: OTHER_TAINT,
        QUARANTINE_TAINT: {"key": QUARANTINE_TAINT, "value": "fatal_xid", "effect": "NoSchedule"},
    }
    labels, annotations = after["metadata"]["labels"], after["metadata"]["annotations"]
    assert labels[STATE_LABEL] == "quarantined"
    assert labels["team.example/owner"] == "infra"
    assert RUN_LABEL not in labels  # the run's pods no longer select it
    assert annotations["opsd.io/reason"] == XID_REASON
    assert annotations["opsd.io/incident"] == "r-1"
    (event,) = events(cluster, "OpsdQuarantine")[:1]
    assert event["type"] == "Warning"
    assert event["involvedObject"]["name"] == "node-1"
    assert {e["involvedObject"]["kind"] for e in events(cluster, "OpsdQuarantine")} == {"Node", "JobSet"}


def test_quarantine_of_a_quarantined_node_writes_nothing(cluster: KubeEmulator, backend: KubernetesBackend) -> None:
    assert backend.quarantine_node(RUN, "node-1", XID_REASON, "r-1") == Done(NodeChanged(changed=True))
    writes = puts(cluster, "node-1")
    assert backend.quarantine_node(RUN, "node-1", XID_REASON, "r-2") == Done(NodeChanged(changed=False))
    assert backend.quarantine_node(RUN, "node-1", XID_REASON, "r-1") == Done(NodeChanged(changed=False))
    assert puts(cluster, "node-1") == writes == 1


class RacingApi(KubeApi):
    """Another controller taints the node between opsd's read and its write, ``races`` times."""

    def __init__(self, kube: KubeEmulator, races: int) -> None:
        super().__init__(kube.api_client)
        self.kube = kube
        self.races = races

    def replace_node(self, node: Json) -> Json:
        if self.races > 0:
            self.races -= 1
            current = self.kube.get("nodes", None, node["metadata"]["name"])
            assert current is not None
            key = f"example.com/other-{self.races}"
            current["spec"]["taints"] = [*(current["spec"].get("taints") or []), {**OTHER_TAINT, "key": key}]
            self.kube.put(current)
        return super().replace_node(node)


def test_a_node_changed_between_read_and_write_is_read_again_and_nothing_is_lost(
    cluster: KubeEmulator, clock: Clock
) -> None:
    backend = KubernetesBackend(RacingApi(cluster, races=2), KubernetesConfig(namespace="opsd"), clock)
    backend.runs[RUN] = RunRef(NAMESPACE, RUN)

    assert backend.quarantine_node(RUN, "node-1", XID_REASON, "r-1") == Done(NodeChanged(changed=True))

    assert set(taints(cluster, "node-1")) == {"example.com/other-1", "example.com/other-0", QUARANTINE_TAINT}
    assert puts(cluster, "node-1") == 3  # two refused with 409, the third written


def test_a_node_that_keeps_changing_is_a_transient_failure(cluster: KubeEmulator, clock: Clock) -> None:
    backend = KubernetesBackend(RacingApi(cluster, races=99), KubernetesConfig(namespace="opsd"), clock)
    backend.runs[RUN] = RunRef(NAMESPACE, RUN)

    outcome = backend.quarantine_node(RUN, "node-1", XID_REASON, "r-1")

    failed(outcome, ErrorKind.TRANSIENT)
    assert QUARANTINE_TAINT not in taints(cluster, "node-1")


def test_release_undoes_only_what_opsd_did(cluster: KubeEmulator, backend: KubernetesBackend) -> None:
    cordoned = cluster.get("nodes", None, "node-0")
    assert cordoned is not None
    cordoned["spec"]["unschedulable"] = True  # cordoned by another tool first
    cluster.put(cordoned)
    backend.quarantine_node(RUN, "node-0", XID_REASON, "r-0")
    backend.quarantine_node(RUN, "node-1", XID_REASON, "r-1")

    assert backend.release_node("node-0", "r-2") == Done(NodeChanged(changed=True))
    assert backend.release_node("node-1", "r-3") == Done(NodeChanged(changed=True))

    for name, unschedulable in (("node-0", True), ("node-1", False)):
        after = cluster.get("nodes", None, name)
        assert after is not None
        assert bool(after["spec"].get("unschedulable")) is unschedulable, name
        assert set(taints(cluster, name)) == {SPARE_TAINT}
        assert after["metadata"]["labels"][POOL_LABEL] == "spare"
        assert CORDONED_BY_OPSD_ANNOTATION not in after["metadata"]["annotations"]
    writes = puts(cluster, "node-1")
    assert backend.release_node("node-1", "r-4") == Done(NodeChanged(changed=False))
    assert puts(cluster, "node-1") == writes


def test_promote_takes_the_spare_into_the_run_once(cluster: KubeEmulator, backend: KubernetesBackend) -> None:
    assert backend.promote_spare(RUN, "node-2", "node-1", "r-1") == Done(NodeChanged(changed=True))
    after = cluster.get("nodes", None, "node-2")
    assert after is not None
    assert SPARE_TAINT not in taints(cluster, "node-2")
    assert POOL_LABEL not in after["metadata"]["labels"]
    assert after["metadata"]["labels"][RUN_LABEL] == RUN
    writes = puts(cluster, "node-2")
    assert backend.promote_spare(RUN, "node-2", "node-1", "r-1") == Done(NodeChanged(changed=False))
    assert puts(cluster, "node-2") == writes
    assert len(events(cluster, "OpsdPromoteSpare")) == 2  # on the node and the JobSet, told once


def test_a_missing_node_is_not_found(backend: KubernetesBackend) -> None:
    outcome = backend.quarantine_node(RUN, "node-9", XID_REASON, "r-1")
    failed(outcome, ErrorKind.NOT_FOUND)


# -- the circuit breaker ------------------------------------------------------------------------------------------
def test_the_circuit_breaker_stops_quarantines_past_its_hourly_limit_across_restarts(
    cluster: KubeEmulator, clock: Clock
) -> None:
    for i in (3, 4):
        cluster.put(node(f"node-{i}", run=RUN))
    backend = backend_on(cluster, clock, quarantines_per_hour=2)
    assert backend.quarantine_node(RUN, "node-0", XID_REASON, "r-0") == Done(NodeChanged(changed=True))
    clock.now_s += 600
    assert backend.quarantine_node(RUN, "node-1", XID_REASON, "r-1") == Done(NodeChanged(changed=True))

    refused = backend.quarantine_node(RUN, "node-3", XID_REASON, "r-3")
    successor = backend_on(cluster, clock, quarantines_per_hour=2)  # a new controller reads the nodes
    also_refused = successor.quarantine_node(RUN, "node-4", XID_REASON, "r-4")

    for outcome in (refused, also_refused):
        message = failed(outcome, ErrorKind.PERMANENT).message
        assert "circuit breaker: 2 nodes quarantined in the last hour (node-0, node-1)" in message
    assert QUARANTINE_TAINT not in taints(cluster, "node-3")
    breaker = events(cluster, "OpsdCircuitBreaker")
    assert {(e["involvedObject"]["kind"], e["type"]) for e in breaker} == {("Node", "Warning"), ("JobSet", "Warning")}

    clock.now_s += 3000 + 1  # node-0's quarantine is more than an hour old
    assert successor.quarantine_node(RUN, "node-3", XID_REASON, "r-5") == Done(NodeChanged(changed=True))
    failed(successor.quarantine_node(RUN, "node-4", XID_REASON, "r-6"), ErrorKind.PERMANENT)


# -- stop: evictions ---------------------------------------------------------------------------------------------
def test_stop_evicts_the_running_pods_of_the_current_attempt(cluster: KubeEmulator, backend: KubernetesBackend) -> None:
    cluster.put(pod("job-0", "node-0"))
    cluster.put(pod("job-1", "node-1"))
    cluster.put(pod("job-done", "node-1", phase="Succeeded"))

    outcome = backend.stop_ranks(RUN, "r-1")

    assert outcome == Done(Stopped(killed=2, restart_attempt=0, launch=0))
    assert sorted(p["metadata"]["name"] for p in cluster.objects("pods", NAMESPACE)) == ["job-done"]
    path = f"/api/v1/namespaces/{NAMESPACE}/pods/job-0/eviction"
    assert cluster.count("POST", path) == 1
    (event,) = events(cluster, "OpsdEvict")
    assert event["metadata"]["annotations"][REQUEST_ANNOTATION] == "r-1"
    assert event["metadata"]["name"] == event_name("r-1", Target("JobSet", RUN, NAMESPACE))


def test_stop_told_again_evicts_nothing_of_the_attempt_the_jobset_started_since(
    cluster: KubeEmulator, backend: KubernetesBackend
) -> None:
    cluster.put(pod("job-0", "node-0"))
    assert backend.stop_ranks(RUN, "r-1") == Done(Stopped(killed=1, restart_attempt=0, launch=0))
    found = cluster.get(JOBSETS, NAMESPACE, RUN)
    assert found is not None
    cluster.put({**found, "status": {"restarts": 1}})  # the JobSet restarted
    cluster.put(pod("job-0-new", "node-0", attempt=1))

    assert backend.stop_ranks(RUN, "r-1") == Done(Stopped(killed=0, restart_attempt=0, launch=0))
    assert cluster.get("pods", NAMESPACE, "job-0-new") is not None
    assert backend.stop_ranks(RUN, "r-2") == Done(Stopped(killed=1, restart_attempt=1, launch=1))  # a new stop does


def test_an_eviction_a_disruption_budget_refuses_is_a_transient_failure(
    cluster: KubeEmulator, backend: KubernetesBackend
) -> None:
    cluster.put(pod("job-0", "node-0"))
    cluster.refuse_evictions(1)

    refused = backend.stop_ranks(RUN, "r-1")

    failed(refused, ErrorKind.TRANSIENT)
    assert "429" in failed(refused, ErrorKind.TRANSIENT).message
    assert cluster.get("pods", NAMESPACE, "job-0") is not None
    assert backend.stop_ranks(RUN, "r-1") == Done(Stopped(killed=1, restart_attempt=0, launch=0))
    assert len(events(cluster, "OpsdEvict")) == 1


def test_a_recovery_waits_out_a_disruption_budget(kube: KubeEmulator, store: StateStore) -> None:
    machines = KubeMachines(kube, RUN)
    kube.refuse_evictions(2)
    try:
        play(machines, store, BY_NAME["kill"])
    finally:
        machines.close()
    evictions = [r for r in kube.requests if r.method == "POST" and r.path.endswith("/eviction")]
    assert len(evictions) == 2 + 2  # two refused, then both pods
    assert machines.player.restarts == 1


# -- relaunch: the JobSet's restart verified ----------------------------------------------------------------------
def test_relaunch_is_pending_until_every_pod_of_the_new_attempt_is_placed(
    cluster: KubeEmulator, backend: KubernetesBackend
) -> None:
    found = cluster.get(JOBSETS, NAMESPACE, RUN)
    assert found is not None
    cluster.put({**found, "status": {"restarts": 1}})
    cluster.put(pod("job-0", "node-0", attempt=1))
    unplaced = pod("job-1", "", attempt=1, phase="Pending")
    cluster.put(unplaced)

    waiting = backend.relaunch(RUN, 2, ["node-0", "node-1"], "r-1")
    assert "1 of 2 pods placed" in pending(waiting).message

    cluster.put({**unplaced, "spec": {**unplaced["spec"], "nodeName": "node-1"}})
    done = backend.relaunch(RUN, 2, ["node-0", "node-1"], "r-1")
    assert done == Done(Launched(restart_attempt=1, nodes=["node-0", "node-1"], pods=2, launch=1))
    assert len(events(cluster, "OpsdRestarted")) == 1


def test_relaunch_is_pending_while_a_pod_sits_on_a_quarantined_node(
    cluster: KubeEmulator, backend: KubernetesBackend
) -> None:
    cluster.put(pod("job-0", "node-0"))
    cluster.put(pod("job-1", "node-1"))
    backend.quarantine_node(RUN, "node-1", XID_REASON, "r-0")

    waiting = backend.relaunch(RUN, 2, ["node-0", "node-2"], "r-1")

    assert "unusable nodes ['node-1']" in pending(waiting).message


def test_a_pod_stuck_terminating_is_deleted_at_once_past_its_grace_period(cluster: KubeEmulator, clock: Clock) -> None:
    backend = backend_on(cluster, clock, force_delete_after_s=60.0)
    cluster.put(pod("job-1", "node-1", grace_s=5))
    cluster.stick_terminating(NAMESPACE, "job-1")
    backend.stop_ranks(RUN, "r-1")
    stuck = cluster.get("pods", NAMESPACE, "job-1")
    assert stuck is not None
    assert stuck["metadata"]["deletionTimestamp"]
    found = cluster.get(JOBSETS, NAMESPACE, RUN)
    assert found is not None
    cluster.put({**found, "status": {"restarts": 1}})

    clock.now_s += 5 + 30  # past the grace period, not yet force_delete_after_s past it
    pending(backend.relaunch(RUN, 2, ["node-0", "node-1"], "r-2"))
    assert cluster.get("pods", NAMESPACE, "job-1") is not None

    clock.now_s += 31
    pending(backend.relaunch(RUN, 2, ["node-0", "node-1"], "r-2"))  # no pods of the new attempt yet
    assert cluster.get("pods", NAMESPACE, "job-1") is None
    forced = [r for r in cluster.requests if r.method == "DELETE" and r.path.endswith("/pods/job-1")]
    assert len(forced) == 1
    assert forced[0].query.get("gracePeriodSeconds") == "0"


def test_a_recovery_gets_past_a_pod_stuck_on_a_dead_node(kube: KubeEmulator, store: StateStore) -> None:
    """The failed node's pod never confirms its deletion: the JobSet cannot start its new attempt until the
    relaunch step deletes it at once."""
    machines = KubeMachines(kube, RUN, grace_s=1)  # force_delete_after_s 1: deleted at once 2 s after eviction
    stuck = f"{RUN}-trainer-1-0-0"  # the pod of the first attempt on node-1
    kube.stick_terminating(NAMESPACE, stuck)
    try:
        play(machines, store, BY_NAME["xid_swap"])
    finally:
        machines.close()
    forced = [r for r in kube.requests if r.method == "DELETE" and r.path.endswith(f"/pods/{stuck}")]
    assert any(r.query.get("gracePeriodSeconds") == "0" for r in forced), forced


def test_dump_and_injection(backend: KubernetesBackend) -> None:
    assert backend.request_dump(RUN, "incident-1", "r-1") == Done(DumpReady(ranks=None))
    outcome = backend.inject(RUN, Fault(FaultKind.KILL, "node-1"), "r-2")
    failed(outcome, ErrorKind.UNSUPPORTED)


def test_a_run_opsd_does_not_know_is_not_found(backend: KubernetesBackend) -> None:
    outcome = backend.stop_ranks("other", "r-1")
    failed(outcome, ErrorKind.NOT_FOUND)


def test_an_event_that_cannot_be_recorded_does_not_fail_the_step(
    cluster: KubeEmulator, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    backend = backend_on(cluster, clock)
    backend.runs[RUN] = RunRef("gone", RUN)  # Events in a namespace that does not exist: 404
    assert backend.promote_spare(RUN, "node-2", "node-1", "r-1") == Done(NodeChanged(changed=True))
    assert "not recorded" in caplog.text


# -- the reconciler ----------------------------------------------------------------------------------------------
def test_the_reconciler_finds_runs_and_node_roles(cluster: KubeEmulator, store: StateStore, clock: Clock) -> None:
    annotated = jobset(
        "other",
        1,
        annotations={
            CHECKPOINT_URL_ANNOTATION: "s3://ckpt/other",
            ON_NO_SPARE_ANNOTATION: "shrink",
            MIN_NODES_ANNOTATION: "not a number",
        },
    )
    cluster.put(annotated)
    cluster.put(jobset("plain", 1, opsd=False))
    cluster.put(node("node-5"))
    cluster.put(pod("other-0", "node-5", run="other"))
    quarantined = backend_on(cluster, clock)
    quarantined.quarantine_node(RUN, "node-1", XID_REASON, "r-1")

    listed_reconciler(backend_on(cluster, clock), store, clock())

    assert {r.id for r in store.runs()} == {RUN, "other"}
    other = store.run("other")
    assert other is not None
    assert other.generation == 1
    assert other.state == RunState.RUNNING
    assert other.spec == RunSpec(
        backend="kubernetes",
        checkpoint_url="s3://ckpt/other",
        on_no_spare=OnNoSpare.SHRINK,
        min_nodes=1,
    ).with_own(RunRef(NAMESPACE, "other"))
    roles = {n.name: (n.role, n.run) for n in store.nodes()}
    assert roles == {
        "node-0": (NodeRole.ACTIVE, RUN),
        "node-1": (NodeRole.CORDONED, None),  # quarantined before this store knew it: of no run now
        "node-2": (NodeRole.SPARE, None),
        "node-5": (NodeRole.ACTIVE, "other"),  # no run label: it runs one of the run's pods
    }
    assert stored(store.node("node-1")).reason == XID_REASON


def test_the_reconciler_follows_releases_attachments_and_endings(
    cluster: KubeEmulator, store: StateStore, clock: Clock
) -> None:
    backend = backend_on(cluster, clock)
    backend.quarantine_node(RUN, "node-1", XID_REASON, "r-1")
    cluster.put(jobset("plain", 1, opsd=False))
    reconciler = listed_reconciler(backend, store, clock())
    assert stored(store.node("node-1")).role == NodeRole.CORDONED

    backend.release_node("node-1", "r-2")
    attached = RunSpec(backend="kubernetes").with_own(RunRef(NAMESPACE, "plain", attached=True))
    store.create_run("attached", attached, clock())
    found = cluster.get(JOBSETS, NAMESPACE, RUN)
    assert found is not None
    cluster.put({**found, "status": {"conditions": [{"type": "Completed", "status": "True"}]}})
    relist(reconciler, clock())

    assert stored(store.node("node-1")).role == NodeRole.SPARE
    assert reconciler.backend.runs["attached"] == RunRef(NAMESPACE, "plain")
    assert stored(store.run(RUN)).state == RunState.COMPLETED
    assert stored(store.run("attached")).state == RunState.RUNNING


def test_a_run_first_seen_in_a_heartbeat_takes_its_jobsets_spec(
    cluster: KubeEmulator, store: StateStore, clock: Clock
) -> None:
    store.create_run(RUN, RunSpec(observed=True), clock())  # a rank's report came before the JobSet was listed

    listed_reconciler(backend_on(cluster, clock), store, clock())

    row = store.run(RUN)
    assert row is not None
    assert row.spec.backend == "kubernetes"
    assert row.spec.own_as(RunRef) == RunRef(NAMESPACE, RUN)
    assert row.generation == 1


# -- the controller's own pod ------------------------------------------------------------------------------------
def test_label_self_marks_the_leaders_pod(cluster: KubeEmulator, caplog: pytest.LogCaptureFixture) -> None:
    cluster.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "opsd"}})
    cluster.put(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "opsd-0", "namespace": "opsd", "labels": {"app": "opsd"}},
            "spec": {"containers": [{"name": "c", "image": "opsd"}]},
        }
    )
    api = KubeApi(cluster.api_client)

    label_self(api, KubernetesConfig(namespace="opsd", pod_name="opsd-0"), "leader")
    label_self(api, KubernetesConfig(namespace="opsd"), "standby")  # outside a pod: nothing
    label_self(api, KubernetesConfig(namespace="opsd", pod_name="gone"), "leader")  # logged, not raised

    found = cluster.get("pods", "opsd", "opsd-0")
    assert found is not None
    assert found["metadata"]["labels"] == {"app": "opsd", ROLE_LABEL: "leader"}
    assert "cannot label this pod leader" in caplog.text


# -- start-up --------------------------------------------------------------------------------------------------------
def test_a_cluster_without_jobsets_stops_the_controller_at_start_up_with_what_to_install(
    cluster: KubeEmulator, tmp_path: Path
) -> None:
    """Discovery says whether JobSets are served: here they are; on a cluster without JobSet's CRD, `opsd serve
    --backend kubernetes` stops before serving, naming what to install."""
    assert KubeApi(cluster.api_client).serves(JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL)
    with kube_emulator(absent=(JOBSETS,)) as bare:
        api = KubeApi(bare.api_client)
        assert not api.serves(JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL)
        with pytest.raises(ConfigError) as refused:
            run_kubernetes(ServeConfig(state_dir=str(tmp_path)), KubernetesConfig(namespace="opsd"), api=api)
        assert f"install JobSet {JOBSET_MIN_RELEASE} or newer" in str(refused.value)
        assert "jobsets.jobset.x-k8s.io/v1alpha2" in str(refused.value)
        assert not (tmp_path / "opsd.db").exists()  # stopped before anything else
