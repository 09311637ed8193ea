"""A run schedules on a fresh cluster with no node labelled by hand: the JobSet of docs/kubernetes.md on the
emulated API server, JobSet's controller and the scheduler played (tests/kube/jobset.py), the controller in this
process. Its pods go to any GPU node but the spares (tainted once, when designated) and the quarantined nodes;
opsd labels the nodes they land on, and after an XID the restarted pods go back to the run's healthy node and the
promoted spare, not to a fresh GPU node an autoscaler added meanwhile (which a run needing more nodes would take)."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

from opsd.backends.kubernetes.api import KubeApi
from opsd.backends.kubernetes.backend import KubernetesBackend
from opsd.backends.kubernetes.cluster import (
    POOL_LABEL,
    QUARANTINE_TAINT,
    RESTART_ATTEMPT_LABEL,
    RUN_LABEL,
    SPARE_POOL,
    SPARE_TAINT,
)
from opsd.backends.kubernetes.config import KubernetesConfig
from opsd.controller.config import ControllerConfig
from opsd.controller.controller import Controller
from opsd.controller.state import StateStore
from opsd.policy.detection import Failure, FailureKind
from opsd.protocol.states import IncidentState, NodeRole
from tests.kube.emulator import KubeEmulator
from tests.kube.jobset import JobSetPlayer
from tests.kube.machines import GPU_LABEL, JOBSETS, Cluster
from tests.rows import stored
from tests.test_kubernetes_takeover import ScriptedKubelet
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[1]
Json = dict[str, Any]


def docs_jobset(nodes: int) -> Json:
    """docs/examples/jobset.yaml as it is, on ``nodes`` nodes (one pod each)."""
    jobset: Json = yaml.safe_load((ROOT / "docs" / "examples" / "jobset.yaml").read_text())
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    job["parallelism"] = job["completions"] = nodes
    for c in job["template"]["spec"]["containers"]:  # quantities as the API server answers them: strings
        for kind, amounts in (c.get("resources") or {}).items():
            c["resources"][kind] = {k: str(v) for k, v in amounts.items()}
    return jobset


def fresh_node(name: str, *, gpu: bool = True) -> Json:
    """A node as the cloud and NVIDIA's feature discovery make it, nothing of opsd's: a GPU node has 8 GPUs
    allocatable (the device plugin's) and the taint GPU pools carry (GKE puts it on every GPU node)."""
    labels = {"kubernetes.io/hostname": name, **({GPU_LABEL: "true"} if gpu else {})}
    spec: Json = {"taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]} if gpu else {}
    status: Json = {"allocatable": {"nvidia.com/gpu": "8"}} if gpu else {}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "spec": spec,
        "status": status,
    }


def designate_spare(kube: KubeEmulator, name: str) -> None:
    """What docs/kubernetes.md has an administrator do once per spare (kubectl label, kubectl taint)."""
    node = kube.get("nodes", None, name)
    assert node is not None
    node["metadata"]["labels"][POOL_LABEL] = SPARE_POOL
    node["spec"]["taints"] = [
        *node["spec"].get("taints", []),
        {"key": SPARE_TAINT, "value": "true", "effect": "NoSchedule"},
    ]
    kube.put(node)


def placement(kube: KubeEmulator, namespace: str, attempt: int) -> list[str]:
    pods = kube.objects("pods", namespace)
    return sorted(
        p["spec"]["nodeName"]
        for p in pods
        if p["metadata"]["labels"][RESTART_ATTEMPT_LABEL] == str(attempt) and p["spec"].get("nodeName")
    )


def labels(kube: KubeEmulator, name: str) -> dict[str, str]:
    node = kube.get("nodes", None, name)
    assert node is not None
    return dict(node["metadata"].get("labels") or {})


@pytest.fixture
def cluster(kube: KubeEmulator) -> Iterator[tuple[KubeEmulator, JobSetPlayer]]:
    kube.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "training"}})
    for name in ("cpu-0", "gpu-a", "gpu-b", "spare-1"):
        kube.put(fresh_node(name, gpu=name != "cpu-0"))
    designate_spare(kube, "spare-1")
    player = JobSetPlayer(kube, ScriptedKubelet())
    player.start()
    try:
        yield kube, player
    finally:
        player.stop()


def test_the_docs_jobset_schedules_on_a_fresh_cluster_and_an_xid_swaps_a_node_for_a_spare(
    cluster: tuple[KubeEmulator, JobSetPlayer], store: StateStore
) -> None:
    kube, player = cluster
    jobset = docs_jobset(nodes=2)
    run, namespace = jobset["metadata"]["annotations"]["opsd.io/run"], jobset["metadata"]["namespace"]
    kube.put(jobset)
    wait_for("placement of both pods", lambda: len(placement(kube, namespace, 0)) == 2, 20)
    assert placement(kube, namespace, 0) == ["gpu-a", "gpu-b"]  # not the CPU node, not the spare

    backend = KubernetesBackend(KubeApi(kube.api_client), KubernetesConfig(namespace="opsd", quarantines_per_hour=10))
    controller = Controller(store, ControllerConfig(step_timeout_s=10.0, step_retry_max_s=0.1), backend)
    controller.recovery.threaded = False
    watched = Cluster(backend, store)
    try:
        watched.reconciler.sync(time.time())
        # the nodes the run's pods landed on are labelled the run's, by opsd
        assert labels(kube, "gpu-a")[RUN_LABEL] == labels(kube, "gpu-b")[RUN_LABEL] == run
        assert RUN_LABEL not in labels(kube, "spare-1")
        wait_for("roles from the labels", lambda: _roles(watched, store) == {"gpu-a": "active", "gpu-b": "active"}, 20)
        assert stored(store.node("spare-1")).role == NodeRole.SPARE

        kube.put(fresh_node("gpu-0"))  # an autoscaler adds a GPU node; it sorts first by name
        row = store.run(run)
        assert row is not None
        xid = Failure(FailureKind.FATAL_XID, "gpu-b", None, "XID 79 on GPU 3: fallen off the bus")
        controller.open_failure(row, [xid], time.time())  # the whole recovery, in this thread
    finally:
        watched.close()

    (incident,) = store.incidents(run)
    kinds = [(a.kind, a.state) for a in store.actions(incident_id=int(incident.id))]
    assert kinds == [("cordon", "done"), ("take_spare", "done"), ("stop", "done"), ("launch", "done")]
    assert (incident.state, incident.spare) == (IncidentState.OPEN, "spare-1")  # its ranks not heard from yet
    assert placement(kube, namespace, 1) == ["gpu-a", "spare-1"]  # the run's own nodes, not gpu-0
    quarantined = kube.get("nodes", None, "gpu-b")
    assert quarantined is not None
    assert quarantined["spec"]["unschedulable"] is True
    assert QUARANTINE_TAINT in {t["key"] for t in quarantined["spec"]["taints"]}
    assert RUN_LABEL not in labels(kube, "gpu-b")
    assert labels(kube, "spare-1")[RUN_LABEL] == run
    assert POOL_LABEL not in labels(kube, "spare-1")
    assert labels(kube, "gpu-0") == fresh_node("gpu-0")["metadata"]["labels"]  # untouched
    found = kube.get(JOBSETS, namespace, jobset["metadata"]["name"])
    assert found is not None
    assert found["status"]["restarts"] == player.restarts == 1


def test_a_larger_run_takes_the_nodes_an_autoscaler_adds(
    cluster: tuple[KubeEmulator, JobSetPlayer], store: StateStore
) -> None:
    """A run wants 3 nodes where 2 GPU nodes are free: it waits Pending (the spare stays a spare) until a fresh node
    comes, as Kueue's or an autoscaler's would, and nobody labels anything."""
    kube, _ = cluster
    jobset = copy.deepcopy(docs_jobset(nodes=3))
    namespace = jobset["metadata"]["namespace"]
    kube.put(jobset)
    wait_for("placement of two pods", lambda: len(placement(kube, namespace, 0)) == 2, 20)
    assert placement(kube, namespace, 0) == ["gpu-a", "gpu-b"]
    kube.put(fresh_node("gpu-c"))
    wait_for("placement of the third pod", lambda: len(placement(kube, namespace, 0)) == 3, 20)
    assert placement(kube, namespace, 0) == ["gpu-a", "gpu-b", "gpu-c"]
    assert POOL_LABEL in labels(kube, "spare-1")


def _roles(watched: Cluster, store: StateStore) -> dict[str, str]:
    watched.reconciler.sync(time.time())
    return {n.name: str(n.role) for n in store.nodes() if n.role == NodeRole.ACTIVE}
