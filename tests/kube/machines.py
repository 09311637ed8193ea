"""A cluster for the Kubernetes backend's tests: the emulated API server (``tests.kube.emulator``), nodes and a
JobSet of a run on it, the JobSet controller and scheduler played (``tests.kube.jobset``), and the backend with its
informers and reconciler, as ``opsd serve --backend kubernetes`` builds them.

``KubeMachines`` is also the Kubernetes backend's entry into the contract suite (``tests.backend_contract``): a
controller's death is a new backend and reconciler over the same cluster (the cluster outlives its controller).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from opsd.backends.kubernetes.api import KubeApi
from opsd.backends.kubernetes.backend import KubernetesBackend
from opsd.backends.kubernetes.cluster import (
    POOL_LABEL,
    RESTART_ATTEMPT_LABEL,
    RUN_ANNOTATION,
    RUN_LABEL,
    SPARE_POOL,
    SPARE_TAINT,
)
from opsd.backends.kubernetes.config import KubernetesConfig
from opsd.backends.kubernetes.events import REQUEST_ANNOTATION
from opsd.backends.kubernetes.leader import cluster_informers
from opsd.backends.kubernetes.runs import Reconciler
from opsd.backends.kubernetes.watch import Cache, Informer
from opsd.controller.controller import Controller
from opsd.controller.port import Backend
from opsd.controller.state import StateStore
from tests.kube.emulator import KubeEmulator
from tests.kube.jobset import JobSetPlayer, Kubelet
from tests.waiting import wait_for

Json = dict[str, Any]
GPU_LABEL = "nvidia.com/gpu.present"
NAMESPACE = "train"
JOBSETS = "jobsets.jobset.x-k8s.io"


def node(name: str, *, spare: bool = False, run: str = "") -> Json:
    labels = {GPU_LABEL: "true", "kubernetes.io/hostname": name}
    taints: list[Json] = []
    if spare:
        labels[POOL_LABEL] = SPARE_POOL
        taints.append({"key": SPARE_TAINT, "value": "true", "effect": "NoSchedule"})
    if run:
        labels[RUN_LABEL] = run
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "spec": {"taints": taints},
        # the device plugin's allocatable, and the kubelet's Ready: it reports so while it runs (an agent's restart
        # leaves it Ready; without the condition the controller's second witness read every node as down)
        "status": {
            "allocatable": {"nvidia.com/gpu": "8"},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def jobset(
    run: str,
    replicas: int,
    *,
    container: Json | None = None,
    annotations: Json | None = None,
    grace_s: int = 30,
    opsd: bool = True,
) -> Json:
    """A user's JobSet wired to opsd (docs/kubernetes.md): the run's annotation (unless not ``opsd``'s), its pods on
    any GPU node, preferring the run's, given ``grace_s`` to stop."""
    pod_spec = {
        "restartPolicy": "Never",
        "nodeSelector": {GPU_LABEL: "true"},
        "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [run_preference(run)]}},
        "terminationGracePeriodSeconds": grace_s,
        "containers": [container or {"name": "trainer", "image": "trainer:1"}],
    }
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {
            "name": run,
            "namespace": NAMESPACE,
            "annotations": {**({RUN_ANNOTATION: run} if opsd else {}), **(annotations or {})},
        },
        "spec": {
            "replicatedJobs": [
                {
                    "name": "trainer",
                    "replicas": replicas,
                    "template": {"spec": {"parallelism": 1, "backoffLimit": 0, "template": {"spec": pod_spec}}},
                }
            ]
        },
    }


def run_preference(run: str) -> Json:
    """The preferred node affinity term of docs/kubernetes.md's JobSet: back onto the run's nodes."""
    return {"weight": 100, "preference": {"matchExpressions": [{"key": RUN_LABEL, "operator": "In", "values": [run]}]}}


def informers(backend: KubernetesBackend, timeout_s: int = 5) -> tuple[Informer, Cache, Cache]:
    """The controller's informers of nodes, pods and JobSets, as ``opsd serve --backend kubernetes`` makes them (a
    watch opened again after ``timeout_s``)."""
    return cluster_informers(backend.api, replace(backend.config, watch_timeout_s=timeout_s))


def listed_reconciler(backend: KubernetesBackend, store: StateStore, now_s: float) -> Reconciler:
    """A reconciler over informers that list once and never watch (the test moves the cluster, then ``relist``),
    after its first pass."""
    nodes, pods, jobsets = informers(backend)
    for informer in (nodes, pods, jobsets):
        informer.relist()
    reconciler = Reconciler(store, backend, jobsets, pods, nodes)
    reconciler.sync(now_s)
    return reconciler


def relist(reconciler: Reconciler, now_s: float) -> None:
    for informer in (reconciler.jobsets, reconciler.pods, reconciler.nodes):
        informer.relist()
    reconciler.sync(now_s)


class Cluster:
    """The emulated cluster's controller side: backend, informers, reconciler (one set per controller lifetime)."""

    def __init__(self, backend: KubernetesBackend, store: StateStore) -> None:
        self.backend = backend
        self.informers = informers(backend)
        for informer in self.informers:
            informer.start()
        for informer in self.informers:
            assert informer.synced.wait(10), f"{informer.kind} never listed"
        nodes, pods, jobsets = self.informers
        self.reconciler = Reconciler(store, backend, jobsets, pods, nodes)

    def close(self) -> None:
        for informer in self.informers:
            informer.stop()


class KubeMachines:
    """The Kubernetes backend under the contract suite: 2 nodes of the run (one pod each) and a spare, or none."""

    name = "kubernetes"

    def __init__(self, kube: KubeEmulator, run: str, kubelet: Kubelet | None = None, grace_s: int = 30) -> None:
        self.kube = kube
        self.run = run
        self.grace_s = grace_s
        self.config = KubernetesConfig(namespace="opsd", quarantines_per_hour=10, force_delete_after_s=1.0)
        self.player = JobSetPlayer(kube, kubelet)
        self.clusters: list[Cluster] = []
        self.backend = self._backend()  # the first controller's; its informers start with the run

    def set_up(self, controller: Controller, nodes: int, spares: int) -> None:
        self.kube.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        for i in range(nodes):
            self.kube.put(node(f"node-{i}", run=self.run))
        for i in range(nodes, nodes + spares):
            self.kube.put(node(f"node-{i}", spare=True))
        self.kube.put(jobset(self.run, nodes, grace_s=self.grace_s))
        self.player.start()
        wait_for("pod running on each node", lambda: len(self.placement()) == nodes, 20)
        self.cluster(controller.store, self.backend)

    def _backend(self) -> KubernetesBackend:
        return KubernetesBackend(KubeApi(self.kube.api_client), self.config)

    def cluster(self, store: StateStore, backend: KubernetesBackend) -> Cluster:
        cluster = Cluster(backend, store)
        cluster.reconciler.sync(time.time())
        self.clusters.append(cluster)
        return cluster

    def restart(self, store: StateStore) -> Backend:
        self.clusters[-1].close()
        return self.cluster(store, self._backend()).backend

    def effects(self) -> list[tuple[str, str, str]]:
        out = []
        for event in self.kube.objects("events"):
            rid = ((event.get("metadata") or {}).get("annotations") or {}).get(REQUEST_ANNOTATION)
            involved = event.get("involvedObject") or {}
            if rid:
                out.append((f"{involved.get('kind')}/{involved.get('name')}", rid, str(event.get("reason"))))
        return out

    def placement(self) -> dict[int, str]:
        """The pods of the JobSet's current attempt running: their rank (order by name) -> node."""
        found = self.kube.get(JOBSETS, NAMESPACE, self.run)
        attempt = str(((found or {}).get("status") or {}).get("restarts", 0))
        pods = sorted(
            (
                p
                for p in self.kube.objects("pods", NAMESPACE)
                if (p["metadata"].get("labels") or {}).get(RESTART_ATTEMPT_LABEL) == attempt
                and (p.get("status") or {}).get("phase") == "Running"
            ),
            key=lambda p: p["metadata"]["name"],
        )
        return {i: p["spec"]["nodeName"] for i, p in enumerate(pods)}

    def invariants(self) -> None:
        """The JobSet restarted once, whatever the crash: its pods were evicted once."""
        assert self.player.restarts == 1, self.player.restarts

    def close(self) -> None:
        self.player.stop()
        for cluster in self.clusters:
            cluster.close()
