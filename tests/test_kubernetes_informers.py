"""The Kubernetes backend's informers on the emulated API server (tests.kube): an informer lists, then follows the
watch; when its watch is too old to resume (410 Gone, the changes compacted away while it was not watching) it lists
again; and bookmarks move a quiet informer's resourceVersion on, so that its next watch does not start too old."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from opsd.backends.kubernetes.api import Json, KubeApi
from opsd.backends.kubernetes.cluster import JOBSET_NAME_LABEL
from opsd.backends.kubernetes.config import KubernetesConfig
from opsd.backends.kubernetes.leader import cluster_informers
from opsd.backends.kubernetes.watch import Informer, InformerSet
from tests.kube.emulator import KubeEmulator, kube_emulator
from tests.kube.machines import node
from tests.waiting import wait_for


class GatedApi(KubeApi):
    """Each watch opens only while ``gate`` is set (a controller that was away)."""

    def __init__(self, kube: KubeEmulator) -> None:
        super().__init__(kube.api_client)
        self.gate = threading.Event()
        self.gate.set()
        self.waiting = threading.Event()

    def watch(self, kind: str, resource_version: str, timeout_s: int, **selectors: str) -> Iterator[Json]:
        if not self.gate.is_set():
            self.waiting.set()
            self.gate.wait()
        yield from super().watch(kind, resource_version, timeout_s, **selectors)


#: the chart's default GPU node terms, as it writes them into controller.kubernetes.node_selector
PLATFORMS = (
    "nvidia.com/gpu.present=true; cloud.google.com/gke-accelerator; feature.node.kubernetes.io/pci-10de.present=true;"
    " karpenter.k8s.aws/instance-gpu-manufacturer=nvidia; eks.amazonaws.com/instance-gpu-manufacturer=nvidia;"
    " k8s.amazonaws.com/accelerator"
)


def names(informer: Informer) -> set[str]:
    return {o["metadata"]["name"] for o in informer.objects()}


@pytest.fixture
def informer_kube() -> Iterator[KubeEmulator]:
    """An emulated API server that sends bookmarks every 0.2 s and keeps 50 changes of history."""
    with kube_emulator(bookmark_interval_s=0.2, history_limit=50) as emulator:
        yield emulator


def test_an_informer_follows_changes_and_lists_again_when_its_watch_is_too_old(informer_kube: KubeEmulator) -> None:
    kube = informer_kube
    kube.put(node("node-0"))
    api = GatedApi(kube)
    informer = Informer(api, "nodes", lambda: api.nodes(""), timeout_s=1)
    informer.start()
    try:
        assert informer.synced.wait(10)
        assert names(informer) == {"node-0"}
        kube.put(node("node-1"))
        wait_for("node-1 in the informer", lambda: names(informer) == {"node-0", "node-1"}, 20)

        api.gate.clear()  # the informer's next watch waits: what changes meanwhile is compacted away
        assert api.waiting.wait(10)
        kube.remove("nodes", None, "node-0")
        kube.put(node("node-2"))
        kube.compact()
        assert informer.relists == 0
        api.gate.set()

        wait_for("changes in the informer", lambda: names(informer) == {"node-1", "node-2"}, 20)
        assert informer.relists == 1  # the watch answered 410: listed again
    finally:
        informer.stop()


def test_bookmarks_move_a_quiet_informer_on(informer_kube: KubeEmulator) -> None:
    kube = informer_kube
    kube.put(node("node-0"))
    api = KubeApi(kube.api_client)
    informer = Informer(api, "nodes", lambda: api.nodes(""), timeout_s=30)
    informer.start()
    try:
        assert informer.synced.wait(10)
        listed = int(informer.resource_version)
        kube.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "elsewhere"}})  # no node changes
        wait_for("bookmark", lambda: int(informer.resource_version) > listed, 20)
        assert informer.relists == 0
        assert names(informer) == {"node-0"}
    finally:
        informer.stop()


def labelled(name: str, labels: dict[str, str]) -> Json:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}, "spec": {}}


def test_the_nodes_informer_of_selectors_ored_keeps_the_gpu_nodes_of_every_platform(
    informer_kube: KubeEmulator,
) -> None:
    """``node_selector`` with terms ORed: every node listed and watched, only the matching ones kept; a node whose
    label goes leaves the cache, one that gets it joins."""
    kube = informer_kube
    kube.put(labelled("operator-node", {"nvidia.com/gpu.present": "true"}))
    kube.put(labelled("gke-node", {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}))
    kube.put(labelled("cpu-node", {"kubernetes.io/os": "linux"}))
    api = KubeApi(kube.api_client)
    informers = cluster_informers(api, KubernetesConfig(node_selector=PLATFORMS, watch_timeout_s=30))
    informer = informers[0]
    informer.start()
    try:
        assert informer.synced.wait(10)
        assert names(informer) == {"operator-node", "gke-node"}
        kube.put(labelled("nfd-node", {"feature.node.kubernetes.io/pci-10de.present": "true"}))
        kube.put(labelled("cpu-node", {"karpenter.k8s.aws/instance-gpu-manufacturer": "nvidia"}))  # now a GPU node
        kube.put(labelled("gke-node", {}))  # its label removed
        wait_for(
            "the informer to follow the labels",
            lambda: names(informer) == {"operator-node", "nfd-node", "cpu-node"},
            20,
        )
    finally:
        informer.stop()


def test_the_runs_of_several_namespaces_are_read_as_one_cache_and_no_other_namespaces(
    informer_kube: KubeEmulator,
) -> None:
    """``watch_namespace`` naming several namespaces (the chart's runNamespaces, a Role in each): an informer per
    namespace, read as one; a pod of a namespace not named is not seen (nor may the controller list it)."""
    kube = informer_kube
    for namespace in ("training", "research", "elsewhere"):
        kube.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"r-{namespace}", "namespace": namespace, "labels": {JOBSET_NAME_LABEL: "r"}},
            "spec": {"containers": [{"name": "c", "image": "i"}]},
        }
        kube.put(pod)
    api = KubeApi(kube.api_client)
    _, pods, jobsets = cluster_informers(api, KubernetesConfig(watch_namespace="training, research"))
    assert isinstance(pods, InformerSet)
    assert isinstance(jobsets, InformerSet)
    pods.start()
    try:
        assert pods.synced.wait(10)
        assert {p["metadata"]["name"] for p in pods.objects()} == {"r-training", "r-research"}
        assert pods.get("research/r-research") is not None
        assert pods.get("elsewhere/r-elsewhere") is None
    finally:
        pods.stop()
    with pytest.raises(ValueError, match="is not a namespace's name"):
        KubernetesConfig(watch_namespace="training,Not_A_Namespace")
