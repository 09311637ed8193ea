"""The operator's commands on a controller with the Kubernetes backend (its API on loopback, the emulated API server
behind it): ``opsd runs attach`` makes an unannotated JobSet a run, ``opsd cordon`` / ``uncordon`` act on the real
node, ``opsd spares`` and ``/metrics`` show the cluster's shared pool."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from opsd.backends.kubernetes.api import KubeApi
from opsd.backends.kubernetes.backend import KubernetesBackend
from opsd.backends.kubernetes.cluster import QUARANTINE_TAINT, SPARE_TAINT
from opsd.backends.kubernetes.config import KubernetesConfig
from opsd.backends.kubernetes.refs import RunRef
from opsd.backends.kubernetes.runs import Reconciler
from opsd.backends.local.processes import free_port
from opsd.cli.app import app
from opsd.controller.controller import Controller
from opsd.controller.state import StateStore
from opsd.protocol.states import NodeRole
from tests.kube.emulator import KubeEmulator
from tests.kube.machines import NAMESPACE, jobset, listed_reconciler, node, relist
from tests.rows import stored
from tests.serving import start_api

TOKEN = "k8s-cli"
RUN = "job"


@dataclass
class Served:
    url: str
    controller: Controller
    reconciler: Reconciler

    def opsd(self, *args: str) -> Any:
        return CliRunner().invoke(app, [*args, "--url", self.url, "--token", TOKEN], env={"COLUMNS": "200"})

    def sync(self) -> None:
        relist(self.reconciler, time.time())


@pytest.fixture
def served(kube: KubeEmulator, store: StateStore) -> Iterator[Served]:
    kube.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    for name, spare in (("node-0", False), ("node-1", False), ("node-2", True), ("node-3", True)):
        kube.put(node(name, spare=spare, run="" if spare else RUN))
    kube.put(jobset(RUN, 2))
    kube.put(jobset("trainjob-7", 1, opsd=False))  # a Kubeflow TrainJob's JobSet: no annotation
    backend = KubernetesBackend(KubeApi(kube.api_client), KubernetesConfig(namespace="opsd"))
    controller = Controller(store, backend=backend)
    reconciler = listed_reconciler(backend, store, time.time())
    port = free_port()
    server = start_api(controller, TOKEN, "127.0.0.1", port)
    try:
        yield Served(f"http://127.0.0.1:{port}", controller, reconciler)
    finally:
        server.should_exit = True


def test_attach_makes_an_unannotated_jobset_a_run(served: Served) -> None:
    attached = served.opsd("runs", "attach", f"{NAMESPACE}/trainjob-7", "--name", "llama")
    assert attached.exit_code == 0, attached.output
    assert f"run llama: {NAMESPACE}/trainjob-7 attached" in attached.stdout
    served.sync()

    assert served.reconciler.backend.runs["llama"] == RunRef(NAMESPACE, "trainjob-7")
    run = served.controller.store.run("llama")
    assert run is not None
    assert run.generation == 1
    assert run.spec.own_as(RunRef).attached is True
    again = served.opsd("runs", "attach", f"{NAMESPACE}/trainjob-7", "--name", "llama", "--json")
    assert again.exit_code == 0, again.output  # idempotent
    assert json.loads(again.stdout)["id"] == "llama"
    listed = served.opsd("runs", "--json")
    assert sorted(r["id"] for r in json.loads(listed.stdout)) == [RUN, "llama"]


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        pytest.param(["trainjob-7"], 1, "expected NAMESPACE/JOBSET", id="no namespace"),
        pytest.param([f"/{RUN}"], 1, "namespace '' is not a Kubernetes object name", id="empty namespace"),
        pytest.param([" "], 2, "a target is needed", id="blank"),
        pytest.param([f"{NAMESPACE}/Bad_Name"], 1, "is not a Kubernetes object name", id="bad jobset name"),
        pytest.param([f"{NAMESPACE}/other", "--name", RUN], 1, "exists already", id="a name taken by another"),
        pytest.param([f"{NAMESPACE}/x", "--name", "a b"], 1, "run name 'a b'", id="bad run name"),
    ],
)
def test_attach_refuses_what_it_cannot_do(served: Served, args: list[str], code: int, message: str) -> None:
    refused = served.opsd("runs", "attach", *args)
    assert refused.exit_code == code, refused.output
    assert message in refused.output


def test_attach_needs_the_kubernetes_backend(tmp_path: Any) -> None:
    controller = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"))
    port = free_port()
    server = start_api(controller, TOKEN, "127.0.0.1", port)
    try:
        url = f"http://127.0.0.1:{port}"
        refused = CliRunner().invoke(app, ["runs", "attach", "a/b", "--url", url, "--token", TOKEN])
    finally:
        server.should_exit = True
    assert refused.exit_code == 1
    assert "this controller's backend (none) attaches nothing" in refused.output


def test_cordon_and_uncordon_act_on_the_node(served: Served, kube: KubeEmulator) -> None:
    cordoned = served.opsd("cordon", "node-1", "--reason", "ECC errors")
    assert cordoned.exit_code == 0, cordoned.output
    found = kube.get("nodes", None, "node-1")
    assert found is not None
    assert found["spec"]["unschedulable"] is True
    assert QUARANTINE_TAINT in {t["key"] for t in found["spec"]["taints"]}
    assert found["metadata"]["annotations"]["opsd.io/reason"] == "ECC errors"

    uncordoned = served.opsd("uncordon", "node-1")
    assert uncordoned.exit_code == 0, uncordoned.output
    served.sync()
    found = kube.get("nodes", None, "node-1")
    assert found is not None
    assert not found["spec"].get("unschedulable")
    assert {t["key"] for t in found["spec"]["taints"]} == {SPARE_TAINT}  # back in the spare pool
    assert stored(served.controller.store.node("node-1")).role == NodeRole.SPARE


def test_spares_and_metrics_show_the_clusters_shared_pool(served: Served) -> None:
    shown = served.opsd("spares", "--json")
    assert shown.exit_code == 0, shown.output
    body = json.loads(shown.stdout)
    shared = body["shared"]
    assert [s["name"] for s in shared["spares"]] == ["node-2", "node-3"]
    assert shared["active_nodes"] == 2
    assert shared["available"] == 2  # not heard from yet: usable
    assert "of 2 nodes of 1 runs" in shared["why"]
    assert [r["run"] for r in body["runs"]] == [RUN]
    table = served.opsd("spares").stdout
    assert re.search(r"^\(shared pool\)\s+2 unknown\s+2\s", table, re.M), table  # by health, then usable
    wide = served.opsd("spares", "--wide").stdout
    assert "node-2 (unknown)" in wide
    assert "node-3 (unknown)" in wide

    scrape = urllib.request.Request(f"{served.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(scrape, timeout=10) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    (available,) = families["opsd_spare_pool_available"].samples
    assert (available.labels, available.value) == ({"pool": "shared"}, 2.0)
    (recommended,) = families["opsd_spare_pool_recommended"].samples
    assert recommended.value == shared["recommended"]
    run_available = {s.labels["run"]: s.value for s in families["opsd_run_spares_available"].samples}
    assert run_available == {RUN: 2.0}  # the run may take the shared pool's spares
