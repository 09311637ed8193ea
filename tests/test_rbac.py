"""The chart's RBAC grants exactly what opsd calls, from the calls themselves: the controller's end-to-end scenario on
the emulated API server (the reconciler's passes, an XID swapped for a spare with a pod stuck on its dead node, the
node given back, the run's key put in a Secret beside its JobSet, leader election on the Lease and the replica's
label on its own pod) and the credentials' hook, each presenting the token of its ServiceAccount; every request is
turned into the attributes a real API server authorizes (verb, API group, resource, namespace, name) and checked
against the Roles and ClusterRoles the chart binds to that ServiceAccount: each call is granted, and each grant is
used (no verb, resource, namespace or name wider than the calls). Run for a controller that watches every namespace
and for one that watches one.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from opsd.backends.kubernetes import credentials
from opsd.backends.kubernetes.api import KubeApi
from opsd.backends.kubernetes.backend import KubernetesBackend
from opsd.backends.kubernetes.cluster import LEADER, RESTART_ATTEMPT_LABEL
from opsd.backends.kubernetes.config import KubernetesConfig
from opsd.backends.kubernetes.leader import KubernetesController, label_self, require_jobsets
from opsd.backends.kubernetes.lease import elect
from opsd.cli import settings
from opsd.controller.config import ControllerConfig
from opsd.controller.controller import Controller
from opsd.controller.state import StateStore
from opsd.policy.detection import Failure, FailureKind
from opsd.protocol.states import NodeRole
from tests.helm_chart import Helm, parse
from tests.kube.api import RecordedRequest, parse_target
from tests.kube.emulator import KubeEmulator
from tests.kube.jobset import JobSetPlayer
from tests.kube.machines import NAMESPACE, jobset, node
from tests.kube.training import kubeconfig
from tests.test_kubernetes_takeover import ScriptedKubelet
from tests.waiting import wait_for

RELEASE_NAMESPACE = "opsd"
CONTROLLER, HOOK = "controller-token", "hook-token"  # the ServiceAccounts' tokens, as the pods present them
RUN = "llm"

Json = dict[str, Any]


@dataclass(frozen=True)
class Call:
    """A request as the API server's authorizer sees it."""

    verb: str
    group: str
    resource: str  # with its subresource: pods/eviction
    namespace: str  # "" for a cluster-scoped resource, or a list across namespaces
    name: str


@dataclass(frozen=True)
class Grant:
    scope: str | None  # a Role's namespace; None: a ClusterRole, every namespace
    group: str
    resource: str
    verb: str
    names: frozenset[str]  # resourceNames; empty: any

    def allows(self, call: Call) -> bool:
        return (
            (self.scope is None or self.scope == call.namespace)
            and (self.group, self.resource, self.verb) == (call.group, call.resource, call.verb)
            and (not self.names or call.name in self.names)
        )


def calls(requests: list[RecordedRequest], user: str) -> set[Call]:
    out = set()
    for r in requests:
        target = parse_target(r.path)
        if r.user != user or target is None:
            continue  # another client's, or discovery (every authenticated user may read it)
        assert target.rtype is not None, r.path
        name = target.name or ""
        if r.method == "GET":
            verb = "watch" if r.query.get("watch") in ("true", "1") else ("get" if name else "list")
        else:
            verb = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}[r.method]
        resource = target.rtype.plural + (f"/{target.subresource}" if target.subresource else "")
        out.add(Call(verb, target.rtype.group, resource, target.namespace, name if verb != "create" else ""))
    return out


def grants(docs: list[Json], service_account: str) -> set[Grant]:
    """Every (scope, group, resource, verb, names) the rendered RBAC gives ``service_account``."""
    roles = {
        (d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d
        for d in docs
        if d["kind"] in ("Role", "ClusterRole")
    }
    out = set()
    for binding in (d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        subjects = {(s["kind"], s["name"], s["namespace"]) for s in binding["subjects"]}
        if ("ServiceAccount", service_account, RELEASE_NAMESPACE) not in subjects:
            continue
        namespace = binding["metadata"].get("namespace")
        ref = binding["roleRef"]
        role = roles[(ref["kind"], None if ref["kind"] == "ClusterRole" else namespace, ref["name"])]
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        out.add(Grant(namespace, group, resource, verb, frozenset(rule.get("resourceNames") or ())))
    return out


def used(grant: Grant, made: set[Call]) -> bool:
    matching = [c for c in made if grant.allows(c)]
    return bool(matching) and (not grant.names or grant.names == {c.name for c in matching})


def check(made: set[Call], given: set[Grant], watch_namespace: str) -> None:
    """Every call granted; every grant used; namespaced resources granted in every namespace only to a controller
    that watches every namespace."""
    refused = sorted(str(c) for c in made if not any(g.allows(c) for g in given))
    assert refused == [], "\n".join(refused)
    unused = sorted(str(g) for g in given if not used(g, made))
    assert unused == [], "granted and never called:\n" + "\n".join(unused)
    cluster_wide = {g.resource for g in given if g.scope is None}
    runs = {"pods", "pods/eviction", "jobsets", "events", "secrets"}  # "secrets": create only (the runs' keys)
    assert cluster_wide <= ({"nodes"} if watch_namespace else {"nodes", *runs})


def render(helm: Helm, watch_namespace: str) -> list[Json]:
    args = ["--namespace", RELEASE_NAMESPACE]
    if watch_namespace:
        args += ["--set-json", f'runNamespaces=["{watch_namespace}"]']
    else:
        args += ["--set", "rbac.clusterWide=true"]  # every namespace: only when asked
    proc = helm.run("template", *args)
    assert proc.returncode == 0, proc.stderr
    return parse(proc.stdout)


def controller_config(docs: list[Json], tmp_path: Path) -> KubernetesConfig:
    """The Kubernetes settings the chart gives the controller (its ConfigMap, loaded by opsd's settings), with the
    controller's pod name and timings made short."""
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap" and "opsd.yaml" in (d.get("data") or {})]
    path = tmp_path / "opsd.yaml"
    path.write_text(config_map["data"]["opsd.yaml"])
    loaded: KubernetesConfig = settings.load("controller", str(path), env={}).section("kubernetes")
    (statefulset,) = [d for d in docs if d["kind"] == "StatefulSet"]
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    secret_env = {e["name"] for e in container.get("env") or [] if "secretKeyRef" in (e.get("valueFrom") or {})}
    return dataclasses.replace(
        loaded,
        # the ranks' secret, as the chart gives it from its Secret: each run's key is put beside its JobSet
        rank_secret="the-ranks-secret" if "OPSD_CONTROLLER_KUBERNETES_RANK_SECRET" in secret_env else "",
        pod_name="opsd-controller-0",
        force_delete_after_s=0.0,
        lease_duration_s=3,
        renew_deadline_s=2,
        retry_period_s=1,
        watch_timeout_s=30,
    )


@pytest.fixture
def cluster(kube: KubeEmulator) -> Iterator[tuple[KubeEmulator, JobSetPlayer]]:
    for namespace in (NAMESPACE, RELEASE_NAMESPACE):
        kube.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    for name in ("node-0", "node-1"):
        kube.put(node(name))
    kube.put(node("node-2", spare=True))
    controller_pod = {"name": "opsd-controller-0", "namespace": RELEASE_NAMESPACE, "labels": {"app": "opsd"}}
    kube.put({"apiVersion": "v1", "kind": "Pod", "metadata": controller_pod, "spec": {"containers": []}})
    player = JobSetPlayer(kube, ScriptedKubelet())
    kube.put(jobset(RUN, 2, grace_s=1))  # a stuck pod is force-deleted a second past its grace period
    player.start()
    wait_for("placement of the run's two pods", lambda: len(placed(kube, 0)) == 2, 20)
    try:
        yield kube, player
    finally:
        player.stop()


def placed(kube: KubeEmulator, attempt: int) -> list[str]:
    return sorted(
        p["spec"]["nodeName"]
        for p in kube.objects("pods", NAMESPACE)
        if p["metadata"]["labels"].get(RESTART_ATTEMPT_LABEL) == str(attempt) and p["spec"].get("nodeName")
    )


def controller_scenario(kube: KubeEmulator, config: KubernetesConfig, store: StateStore) -> None:
    """What the controller does on a cluster, end to end, with its ServiceAccount's token."""
    api = KubeApi(kube.client(CONTROLLER))
    require_jobsets(api)  # at start-up
    backend = KubernetesBackend(api, config)
    controller = Controller(store, ControllerConfig(step_timeout_s=15.0, step_retry_max_s=0.1), backend)
    controller.recovery.threaded = False
    leader = KubernetesController(controller, api, config, tick_interval_s=0.25)
    lease_renewed = threading.Event()
    try:
        for informer in (leader.nodes, leader.pods, leader.jobsets):
            informer.start()
        for informer in (leader.nodes, leader.pods, leader.jobsets):
            assert informer.synced.wait(10), informer.kind
        wait_for(
            "label on the run's nodes", lambda: _synced(leader) and kube.count("PUT", "/api/v1/nodes/node-0") > 0, 20
        )
        dead = next(p for p in kube.objects("pods", NAMESPACE) if p["spec"].get("nodeName") == "node-1")
        kube.stick_terminating(NAMESPACE, dead["metadata"]["name"])  # its node does not answer: force-deleted
        run = store.run(RUN)
        assert run is not None
        xid = Failure(FailureKind.FATAL_XID, "node-1", None, "XID 79 on GPU 0: fallen off the bus")
        controller.open_failure(run, [xid], time.time())
        assert placed(kube, 1) == ["node-0", "node-2"]
        controller.set_node_role("node-1", NodeRole.SPARE, "", time.time())  # opsd uncordon: back to the pool
        label_self(api, config, LEADER)

        def lead() -> None:
            lease_renewed.wait()

        def campaign() -> None:
            try:
                elect(api, config, "opsd-controller-0", lead)
            except Exception:  # it renews until the emulated server goes, after the test
                if not lease_renewed.is_set():
                    raise

        threading.Thread(target=campaign, name="election", daemon=True).start()
        lease = f"/apis/coordination.k8s.io/v1/namespaces/{RELEASE_NAMESPACE}/leases/{config.lease_name}"
        wait_for("renewal of the Lease", lambda: kube.count("PUT", lease) > 0, 20)
    finally:
        lease_renewed.set()
        leader.close()


def _synced(leader: KubernetesController) -> bool:
    leader.reconciler.sync(time.time())
    return True


@pytest.mark.parametrize("watch_namespace", ["", NAMESPACE], ids=["every-namespace", "one-namespace"])
def test_the_controllers_rbac_is_what_it_calls(
    cluster: tuple[KubeEmulator, JobSetPlayer], helm: Helm, store: StateStore, tmp_path: Path, watch_namespace: str
) -> None:
    kube, _ = cluster
    docs = render(helm, watch_namespace)
    config = controller_config(docs, tmp_path)
    assert config.watch_namespace == watch_namespace
    controller_scenario(kube, config, store)
    made = calls(kube.requests, CONTROLLER)
    given = grants(docs, "opsd-controller")
    check(made, given, watch_namespace)
    # the grants a careless chart gives, named: none here
    verbs = {(g.resource, g.verb) for g in given}
    assert ("nodes", "patch") not in verbs
    assert all(g.names == {"opsd-controller-0"} for g in given if (g.resource, g.verb) == ("pods", "patch"))
    if watch_namespace:
        runs = {g.scope for g in given if g.resource in ("pods/eviction", "jobsets", "pods") and g.verb != "patch"}
        assert runs == {watch_namespace}  # nothing of the runs' in any other namespace


def test_the_credentials_hooks_rbac_is_what_it_calls(kube: KubeEmulator, helm: Helm, tmp_path: Path) -> None:
    kube.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": RELEASE_NAMESPACE}})
    docs = render(helm, "")
    (job,) = [d for d in docs if d["kind"] == "Job"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    config = ["--kubeconfig", str(kubeconfig(kube, tmp_path / "kubeconfig", token=HOOK))]
    args = container["command"][3:]
    assert credentials.main([*args, *config]) == 0  # helm install: made
    assert credentials.main([*args, *config]) == 0  # helm upgrade: kept
    generation = args.index("--generation") + 1
    assert credentials.main([*args[:generation], "2", *args[generation + 1 :], *config]) == 0  # rotated
    check(calls(kube.requests, HOOK), grants(docs, job["spec"]["template"]["spec"]["serviceAccountName"]), "x")


def test_the_check_catches_a_wider_grant_and_a_missing_one() -> None:
    """The checks above can fail: a grant of patch beside update, and a call nothing grants."""
    update = Grant(None, "", "nodes", "update", frozenset())
    call = Call("update", "", "nodes", "", "node-1")
    check({call}, {update}, "")
    with pytest.raises(AssertionError, match="never called"):
        check({call}, {update, Grant(None, "", "nodes", "patch", frozenset())}, "")
    with pytest.raises(AssertionError, match="delete"):
        check({call, Call("delete", "", "pods", "train", "p")}, {update}, "")
    named = Grant("opsd", "", "pods", "patch", frozenset({"a", "b"}))
    assert not used(named, {Call("patch", "", "pods", "opsd", "a")})  # resourceNames wider than the names used
