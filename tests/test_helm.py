"""The Helm chart (helm/opsd), rendered by a real helm v4 (`tools/install_helm.py` puts it at .venv/bin/helm).

Every values set (the defaults and each helm/opsd/ci/*.yaml) is linted with `helm lint --strict` and rendered with
`helm template` for the lowest and highest Kubernetes versions the chart supports, the renderings with and
without the Prometheus Operator's API (`helm lint` has no --api-versions); each rendering is made once (a module
fixture) and the assertions read the parsed objects. Built-in objects pass kubernetes-validate's strict schemas
of that Kubernetes version; the ServiceMonitor, PodMonitor, PrometheusRule and the docs' JobSet pass the schemas
in tests/schemas/, made from the upstream CRDs. Also here: the values schema refusing bad values, the chart's own
refusals, the dashboards and rules being the repository's files, yamllint on the chart's YAML, the Dockerfile,
and the JobSet example of docs/kubernetes.md.
"""

from __future__ import annotations

import base64
import copy
import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import tomllib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml  # type: ignore[import-untyped]
from yamllint import linter as yamllint_linter  # type: ignore[import-untyped]
from yamllint.config import YamlLintConfig  # type: ignore[import-untyped]

from agent.daemon import Agent, AgentConfig
from opsd.backends.kubernetes.credentials import main as credentials_main
from opsd.backends.local.processes import free_port
from opsd.controller.controller import Controller
from opsd.controller.state import StateStore
from tests.kube.emulator import KubeEmulator
from tests.kube.training import kubeconfig
from tests.pod_security import api_refusals, level_of, violations
from tests.serving import start_api

Obj = dict[str, Any]

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "opsd"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
DASHBOARDS = ROOT / "dashboards"
RULES = DASHBOARDS / "rules" / "opsd.rules.yaml"
JOBSET_EXAMPLE = ROOT / "docs" / "examples" / "jobset.yaml"

RELEASE = "opsd"
NAMESPACE = "opsd"
KUBE_VERSIONS = ("1.29.0", "1.37.0")  # the chart's kubeVersion floor, and the newest kubernetes-validate knows
MONITORING_API = "monitoring.coreos.com/v1"
# `helm lint` has no --api-versions: the chart's apiVersions value tells it (and any render without a cluster)
API_ARGS = ("--set-json", f'apiVersions=["{MONITORING_API}"]')
MONITORING_KINDS = {"serviceMonitor": "ServiceMonitor", "podMonitor": "PodMonitor", "prometheusRule": "PrometheusRule"}
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule.json",
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): "jobset.json",
}
VALUE_SETS = ("default", *sorted(p.name for p in (CHART / "ci").glob("*.yaml")))


# -- finding helm and rendering ----------------------------------------------------------------------------------------


def find_helm() -> str | None:
    """.venv/bin/helm of the repository (what `make` installs), else $OPSD_HELM, else helm on PATH."""
    local = ROOT / ".venv" / "bin" / "helm"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    env = os.environ.get("OPSD_HELM")
    if env and Path(env).is_file():
        return env
    return shutil.which("helm")


@dataclass(frozen=True)
class Combo:
    values: str  # "default" or the name of a file in helm/opsd/ci
    kube: str
    api: bool  # whether monitoring.coreos.com/v1 is served

    @property
    def id(self) -> str:
        minor = self.kube.rsplit(".", 1)[0]
        return f"{self.values.removesuffix('-values.yaml')}-k{minor}-{'api' if self.api else 'noapi'}"


COMBOS = [Combo(v, k, a) for v in VALUE_SETS for k in KUBE_VERSIONS for a in (True, False)]
DEFAULT = Combo("default", "1.37.0", True)


def values_args(values: str) -> list[str]:
    return [] if values == "default" else ["-f", str(CHART / "ci" / values)]


def values_of(values: str) -> Obj:
    """The values a set overrides ({} for the defaults)."""
    return {} if values == "default" else yaml.safe_load((CHART / "ci" / values).read_text()) or {}


@dataclass(frozen=True)
class Helm:
    path: str

    def run(
        self, verb: str, *args: str, chart: Path | str = CHART, release: str = RELEASE
    ) -> subprocess.CompletedProcess[str]:
        """`helm VERB [RELEASE] CHART ARGS...` (the release name for template and install)."""
        named = [release] if verb in ("template", "install") else []
        cmd = [self.path, verb, *named, str(chart), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)

    def template(
        self, *args: str, kube: str = "1.37.0", api: bool = True, chart: Path | str = CHART
    ) -> subprocess.CompletedProcess[str]:
        api_args = ["--api-versions", MONITORING_API] if api else []
        return self.run("template", "--namespace", NAMESPACE, "--kube-version", kube, *api_args, *args, chart=chart)

    def render(self, *args: str, kube: str = "1.37.0", api: bool = True) -> list[Obj]:
        proc = self.template(*args, kube=kube, api=api)
        assert proc.returncode == 0, proc.stderr
        return parse(proc.stdout)


def parse(manifest: str) -> list[Obj]:
    return [doc for doc in yaml.safe_load_all(manifest) if doc]


@pytest.fixture(scope="module")
def renders(helm: Helm) -> dict[Combo, list[Obj]]:
    """Every combination rendered once (two at a time: helm is quick, the machine is small)."""

    def one(combo: Combo) -> list[Obj]:
        return helm.render(*values_args(combo.values), kube=combo.kube, api=combo.api)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(COMBOS, pool.map(one, COMBOS), strict=True))


@pytest.fixture(scope="module")
def default(renders: dict[Combo, list[Obj]]) -> list[Obj]:
    return renders[DEFAULT]


def objects(docs: list[Obj], kind: str) -> list[Obj]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = [d for d in objects(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"{len(found)} {kind} named {name}: {[d['metadata']['name'] for d in objects(docs, kind)]}"
    return found[0]


def container(workload: Obj) -> Obj:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def env(c: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in c.get("env", [])}


def secret_ref(c: Obj, name: str) -> tuple[str, str]:
    ref = env(c)[name]["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


def pod_templates(docs: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    for d in docs:
        if d["kind"] in ("StatefulSet", "DaemonSet"):
            yield d, d["spec"]["template"]


# -- lint and render matrix --------------------------------------------------------------------------------------------


LINTS = [Combo(v, KUBE_VERSIONS[0], False) for v in VALUE_SETS] + [
    Combo(v, KUBE_VERSIONS[-1], True) for v in VALUE_SETS
]


@pytest.mark.parametrize("combo", LINTS, ids=lambda c: c.id)
def test_lint_strict(helm: Helm, combo: Combo) -> None:
    """Each values set at the oldest Kubernetes without the monitors' API, and at the newest with it (told through
    apiVersions: lint renders and checks the monitors too)."""
    api = API_ARGS if combo.api else ()
    proc = helm.run(
        "lint", "--strict", "--namespace", NAMESPACE, "--kube-version", combo.kube, *api, *values_args(combo.values)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


def test_lint_refuses_what_template_refuses(helm: Helm) -> None:
    """`helm lint` lets `fail` pass: the chart's refusals stop it all the same, and apiVersions stands for
    --api-versions."""
    forced = ("--set", "monitoring.serviceMonitor.enabled=true")
    lint = helm.run("lint", "--strict", *forced)
    assert lint.returncode != 0
    assert "monitoring.serviceMonitor.enabled is true" in lint.stdout + lint.stderr
    assert helm.template(*forced, api=False).returncode != 0
    assert helm.run("lint", "--strict", *forced, *API_ARGS).returncode == 0
    kinds = {d["kind"] for d in parse(helm.template(*forced, *API_ARGS, api=False).stdout)}
    assert "ServiceMonitor" in kinds  # a render without a cluster, told by the values
    lint = helm.run("lint", "--strict", "--set", "controller.replicas=2")
    assert lint.returncode != 0
    assert "controller.replicas is 2" in lint.stdout + lint.stderr


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: c.id)
def test_objects_are_unique_and_namespaced(renders: dict[Combo, list[Obj]], combo: Combo) -> None:
    docs = renders[combo]
    keys = [(d["apiVersion"], d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys)), keys
    cluster_scoped = {"ClusterRole", "ClusterRoleBinding"}
    dashboards_ns = values_of(combo.values).get("monitoring", {}).get("dashboards", {}).get("namespace")
    for d in docs:
        ns = d["metadata"].get("namespace")
        if d["kind"] in cluster_scoped:
            assert ns is None, d["metadata"]
        elif d["metadata"]["name"].startswith(f"{RELEASE}-dashboard-") and dashboards_ns:
            assert ns == dashboards_ns
        else:
            assert ns == NAMESPACE, d["metadata"]


@functools.cache
def validate_builtin(kube: str, obj_json: str) -> None:
    """kubernetes-validate --strict, once per distinct object and version (the matrix repeats many)."""
    kubernetes_validate.validate(json.loads(obj_json), kube, strict=True)


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: c.id)
def test_builtin_objects_pass_kubernetes_validate(renders: dict[Combo, list[Obj]], combo: Combo) -> None:
    for d in renders[combo]:
        if (d["apiVersion"], d["kind"]) in CRD_SCHEMAS:
            continue
        if d["kind"] == "Secret":  # a fresh random token each time: nothing to share with other renders
            d = {**d, "data": {k: "" for k in d.get("data", {})}}
        try:
            validate_builtin(combo.kube, json.dumps(d, sort_keys=True))
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{d['kind']}/{d['metadata']['name']} at {list(e.path)}: {e.message}")


@functools.cache
def crd_validator(file: str) -> Any:
    schema = json.loads((SCHEMAS / file).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def crd_errors(obj: Obj) -> list[str]:
    validator = crd_validator(CRD_SCHEMAS[(obj["apiVersion"], obj["kind"])])
    return [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(obj)]


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: c.id)
def test_custom_resources_pass_their_crd_schemas(renders: dict[Combo, list[Obj]], combo: Combo) -> None:
    for d in renders[combo]:
        if (d["apiVersion"], d["kind"]) in CRD_SCHEMAS:
            assert crd_errors(d) == [], d["metadata"]["name"]


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: c.id)
def test_monitors_and_rules_only_where_the_api_is_served(renders: dict[Combo, list[Obj]], combo: Combo) -> None:
    values = values_of(combo.values)
    expected = set()
    for key, kind in MONITORING_KINDS.items():
        enabled = values.get("monitoring", {}).get(key, {}).get("enabled", "auto")
        agent = values.get("agent", {}).get("enabled", True)
        if combo.api and enabled is not False and (key != "podMonitor" or agent):
            expected.add(kind)
    found = {d["kind"] for d in renders[combo] if d["apiVersion"] == MONITORING_API}
    assert found == expected


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: c.id)
def test_standard_labels_on_every_object(renders: dict[Combo, list[Obj]], combo: Combo) -> None:
    values = values_of(combo.values)
    name = values.get("nameOverride") or "opsd"
    standard = {
        "helm.sh/chart": "opsd-0.1.0",
        "app.kubernetes.io/name": name,
        "app.kubernetes.io/instance": RELEASE,
        "app.kubernetes.io/version": "0.1.0",
        "app.kubernetes.io/managed-by": "Helm",
        **values.get("commonLabels", {}),
    }
    docs = renders[combo]
    for d in docs:
        labels = d["metadata"].get("labels", {})
        assert standard.items() <= labels.items(), (d["kind"], d["metadata"]["name"], labels)
    for workload, template in pod_templates(docs):
        assert standard.items() <= template["metadata"]["labels"].items(), workload["metadata"]["name"]
        selector = workload["spec"]["selector"]["matchLabels"]
        assert selector.items() <= template["metadata"]["labels"].items()
        assert set(selector) == {"app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component"}


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: c.id)
def test_no_wildcard_in_rbac(renders: dict[Combo, list[Obj]], combo: Combo) -> None:
    for d in renders[combo]:
        if d["kind"] in ("ClusterRole", "Role"):
            for rule in d["rules"]:
                assert "nonResourceURLs" not in rule
                for field in ("apiGroups", "resources", "verbs", "resourceNames"):
                    assert not any("*" in item for item in rule.get(field, [])), (d["metadata"]["name"], rule)


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: c.id)
def test_pod_security_levels_of_the_charts_pods(renders: dict[Combo, list[Obj]], combo: Combo) -> None:
    """The controller and the `helm test` pod fit Pod Security "restricted"; the agent needs "privileged", for the
    reasons docs/kubernetes.md gives: its transport (host ports, the node's network, or a hostPath) and, with
    gpuAccess privileged or hostDriver, a privileged container with the host's driver mounted."""
    agent = values_of(combo.values).get("agent", {})
    transport, access = agent.get("transport", "hostPort"), agent.get("gpuAccess", "runtime")
    expected = {"hostPort": {"Host ports"}, "hostNetwork": {"Host namespaces"}, "hostPath": {"HostPath volumes"}}
    for d in renders[combo]:
        if d["kind"] in ("StatefulSet", "Job", "Pod"):
            spec = d["spec"] if d["kind"] == "Pod" else d["spec"]["template"]["spec"]
            assert violations(spec, "restricted") == [], d["metadata"]["name"]
        elif d["kind"] == "DaemonSet":
            spec = d["spec"]["template"]["spec"]
            controls = {v.split(":")[0] for v in violations(spec, "baseline")}
            wanted = set(expected[transport])
            if access != "runtime":
                wanted.add("Privileged containers")
            if access == "hostDriver":
                wanted.add("HostPath volumes")
            assert controls == wanted
            assert level_of(spec) == "privileged"
            assert api_refusals(spec) == []


# -- what the default values render ------------------------------------------------------------------------------------


def grants(role: Obj) -> dict[tuple[str, str, tuple[str, ...]], list[str]]:
    """(API group, resource, resourceNames) -> verbs, each once."""
    out: dict[tuple[str, str, tuple[str, ...]], list[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                key = (group, resource, tuple(rule.get("resourceNames") or ()))
                assert key not in out, f"{key} granted twice"
                out[key] = rule["verbs"]
    return out


RUNS_GRANTS = {  # where the runs are: every namespace, or controller.config.kubernetes.watch_namespace
    ("", "pods", ()): ["list", "watch", "delete"],
    ("", "pods/eviction", ()): ["create"],
    ("jobset.x-k8s.io", "jobsets", ()): ["get", "list", "watch"],
    ("", "events", ()): ["create", "get"],
}
NODE_GRANTS = {("", "nodes", ()): ["get", "list", "watch", "update"]}  # replaced whole: no patch
LEADER_GRANTS = {
    ("coordination.k8s.io", "leases", ()): ["create"],
    ("coordination.k8s.io", "leases", ("opsd-leader",)): ["get", "update"],
    ("", "pods", ("opsd-controller-0",)): ["patch"],  # its own pod's opsd.io/role label, and no other pod
}


def test_rbac_grants_what_the_backend_calls(default: list[Obj]) -> None:
    """The rules as tests/test_rbac.py proves them from the calls (the emulated API server's request log)."""
    assert grants(one(default, "ClusterRole", "opsd-controller")) == NODE_GRANTS | RUNS_GRANTS
    assert grants(one(default, "Role", "opsd-leader-election")) == LEADER_GRANTS
    subject = [{"kind": "ServiceAccount", "name": "opsd-controller", "namespace": NAMESPACE}]
    binding = one(default, "ClusterRoleBinding", "opsd-controller")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "opsd-controller",
    }
    assert binding["subjects"] == subject
    role_binding = one(default, "RoleBinding", "opsd-leader-election")
    assert role_binding["roleRef"]["name"] == "opsd-leader-election"
    assert role_binding["subjects"] == subject
    controller = one(default, "StatefulSet")
    assert controller["spec"]["template"]["spec"]["serviceAccountName"] == "opsd-controller"
    one(default, "ServiceAccount", "opsd-controller")


def test_a_controller_that_watches_one_namespace_may_act_in_that_one_only(helm: Helm) -> None:
    docs = helm.render("--set", "controller.config.kubernetes.watch_namespace=training")
    assert grants(one(docs, "ClusterRole", "opsd-controller")) == NODE_GRANTS
    runs = one(docs, "Role", "opsd-controller-runs")
    assert runs["metadata"]["namespace"] == "training"
    assert grants(runs) == RUNS_GRANTS
    node_events = one(docs, "Role", "opsd-controller-node-events")
    assert node_events["metadata"]["namespace"] == "default"  # where a cluster-scoped object's Events live
    assert grants(node_events) == {("", "events", ()): ["create"]}
    for name in ("opsd-controller-runs", "opsd-controller-node-events"):
        assert one(docs, "RoleBinding", name)["subjects"][0]["name"] == "opsd-controller"
    two = helm.render("--set", "controller.replicas=2", "--set", "postgresql.url=postgresql+psycopg://opsd@db/opsd")
    pods = grants(one(two, "Role", "opsd-leader-election"))
    assert pods[("", "pods", ("opsd-controller-0", "opsd-controller-1"))] == ["patch"]


def test_rbac_without_pod_delete_and_without_leader_election(renders: dict[Combo, list[Obj]]) -> None:
    no_delete = renders[Combo("no-agent-values.yaml", "1.37.0", True)]
    assert grants(one(no_delete, "ClusterRole"))[("", "pods", ())] == ["list", "watch"]
    no_election = renders[Combo("agent-custom-values.yaml", "1.37.0", True)]
    assert [r["metadata"]["name"] for r in objects(no_election, "Role")] == ["trainops-credentials"]  # the hook's
    assert not [b for b in objects(no_election, "RoleBinding") if "leader" in b["metadata"]["name"]]
    settings = yaml.safe_load(one(no_election, "ConfigMap", "trainops-config")["data"]["opsd.yaml"])
    assert settings["controller"]["kubernetes"]["leader_election"] is False
    service = [s for s in objects(no_election, "Service") if "controller" in s["metadata"]["name"]]
    assert [s["spec"]["selector"].get("opsd.io/role") for s in service] == [None]  # one replica: always it


def test_controller_statefulset(default: list[Obj]) -> None:
    controller = one(default, "StatefulSet", "opsd-controller")
    spec = controller["spec"]
    pod = spec["template"]["spec"]
    c = container(controller)
    assert spec["replicas"] == 1
    # pods of known names (the leader-election Role names them), replaced one at a time: the old one gone first
    assert (spec["serviceName"], spec["podManagementPolicy"]) == ("opsd-controller", "Parallel")
    assert spec["updateStrategy"] == {"type": "RollingUpdate"}
    assert c["image"] == "opsd:0.1.0"  # the tag defaults to the chart's appVersion
    assert c["command"] == ["opsd"]
    assert c["args"] == ["serve", "--config", "/etc/opsd/opsd.yaml", "--backend", "kubernetes"]
    assert c["ports"] == [
        {"name": "http", "containerPort": 8470, "protocol": "TCP"},
        {"name": "liveness", "containerPort": 8470, "protocol": "UDP"},  # the agents' liveness datagrams
    ]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "http"}, probe
    assert secret_ref(c, "OPSD_TOKEN") == ("opsd-credentials", "operator")  # a token per role of the API
    assert secret_ref(c, "OPSD_CONTROLLER_READER_TOKEN") == ("opsd-credentials", "reader")
    assert secret_ref(c, "OPSD_CONTROLLER_AGENT_TOKEN") == ("opsd-credentials", "agent")
    assert secret_ref(c, "OPSD_CONTROLLER_METRICS_TOKEN") == ("opsd-credentials", "metrics")
    assert env(c)["OPSD_STATE_DIR"]["value"] == "/var/lib/opsd"
    assert env(c)["OPSD_CONTROLLER_KUBERNETES_POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert "OPSD_STATE_URL" not in env(c)
    assert not any(name.startswith("AWS_") for name in env(c))
    assert pod["securityContext"]["runAsNonRoot"] is True
    security = c["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/tmp"]]["emptyDir"] == {}
    assert volumes[mounts["/etc/opsd"]]["configMap"] == {"name": "opsd-config"}
    assert volumes[mounts["/var/lib/opsd"]]["persistentVolumeClaim"] == {"claimName": "opsd-state"}
    one(default, "PersistentVolumeClaim", "opsd-state")
    assert c["resources"]["requests"]
    assert c["resources"]["limits"]
    assert re.fullmatch(r"[0-9a-f]{64}", spec["template"]["metadata"]["annotations"]["checksum/config"])


def test_controller_service_and_disruption_budget(default: list[Obj]) -> None:
    service = one(default, "Service", "opsd-controller")
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 8470, "targetPort": "http", "protocol": "TCP"},
        {"name": "liveness", "port": 8470, "targetPort": "liveness", "protocol": "UDP"},  # the port replies name
    ]
    pod_labels = one(default, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    selector = dict(service["spec"]["selector"])
    assert selector.pop("opsd.io/role") == "leader"  # set at run time by the replica that leads
    assert selector.items() <= pod_labels.items()
    pdb = one(default, "PodDisruptionBudget", "opsd-controller")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert "minAvailable" not in pdb["spec"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    monitor = one(default, "ServiceMonitor", "opsd-controller")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")  # metrics on the API's port
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()


def test_settings_file(default: list[Obj]) -> None:
    config = one(default, "ConfigMap", "opsd-config")
    settings = yaml.safe_load(config["data"]["opsd.yaml"])
    assert settings == {
        "controller": {
            "host": "0.0.0.0",
            "port": 8470,
            "liveness_port": 8470,
            "tick_interval_s": 0.5,
            "detection": {"heartbeat_floor_s": 10, "hang_floor_s": 60},
            "kubernetes": {
                "namespace": NAMESPACE,
                "node_selector": "nvidia.com/gpu.present=true",
                "lease_name": "opsd-leader",
                "leader_election": True,
                "quarantines_per_hour": 4,
            },
        },
        "agent": {
            "socket": "/tmp/opsd-agent.sock",  # in the pod's own /tmp: the ranks send to the node's address
            "metrics_host": "0.0.0.0",
            "metrics_port": 9464,
            "datagram_host": "0.0.0.0",
            "datagram_port": 9465,
            "gpu_source": "nvml",
            "flight_dir": "/var/spool/opsd/flight",
            "heartbeat_interval_s": 1,
        },
    }


@pytest.mark.parametrize("combo", COMBOS, ids=str)
def test_opsd_reads_the_rendered_settings_and_every_variable_the_chart_sets(
    renders: dict[Combo, list[Obj]], combo: Combo, tmp_path: Path
) -> None:
    """The chart's settings file loads with opsd's own settings object (keys and types it knows), and each OPSD_*
    variable of the controller's and the agent's containers is one of its keys (or a client's)."""
    from opsd.cli import settings
    from opsd.protocol import env as opsd_env

    docs = renders[combo]
    configs = [c for c in objects(docs, "ConfigMap") if "opsd.yaml" in (c.get("data") or {})]
    assert len(configs) == 1
    path = tmp_path / "opsd.yaml"
    path.write_text(configs[0]["data"]["opsd.yaml"])
    controller = settings.load("controller", str(path), env={})
    assert controller.backend in ("none", "kubernetes")
    settings.load("agent", str(path), env={})
    known = {k.env for section in settings.SECTIONS for k in settings.keys(section)}
    known |= {v for k, v in vars(opsd_env).items() if k.endswith("_ENV") and isinstance(v, str)}
    for workload in (*objects(docs, "StatefulSet"), *objects(docs, "DaemonSet")):
        names = {n for n in env(container(workload)) if n.startswith("OPSD_")}
        assert names <= known, (workload["metadata"]["name"], sorted(names - known))


def test_agent_daemonset(default: list[Obj]) -> None:
    daemonset = one(default, "DaemonSet", "opsd-agent")
    pod = daemonset["spec"]["template"]["spec"]
    c = container(daemonset)
    assert daemonset["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"] == [{"operator": "Exists"}]
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["automountServiceAccountToken"] is False
    assert pod["serviceAccountName"] == "opsd-agent"
    assert c["command"] == ["opsd"]
    assert c["args"] == ["agent", "--config", "/etc/opsd/opsd.yaml"]
    assert c["ports"] == [  # the node's ports: the ranks reach the agent at their pod's status.hostIP
        {"name": "metrics", "containerPort": 9464, "hostPort": 9464, "protocol": "TCP"},
        {"name": "datagrams", "containerPort": 9465, "hostPort": 9465, "protocol": "UDP"},
    ]
    assert "hostNetwork" not in pod
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    variables = env(c)
    assert variables["OPSD_AGENT_NODE"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert variables["OPSD_AGENT_CONTROLLER_URL"]["value"] == "http://opsd-controller:8470/v1/heartbeat"
    assert secret_ref(c, "OPSD_CONTROLLER_TOKEN") == ("opsd-credentials", "agent")  # heartbeats only
    assert secret_ref(c, "OPSD_AGENT_METRICS_TOKEN") == ("opsd-credentials", "metrics")
    assert variables["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert variables["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "utility"
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/var/spool/opsd"]]["emptyDir"] == {}  # the dumps the ranks send, until uploaded
    assert not [v for v in pod["volumes"] if "hostPath" in v]
    assert volumes[mounts["/etc/opsd"]]["configMap"] == {"name": "opsd-config"}
    assert volumes[mounts["/tmp"]]["emptyDir"] == {}
    security = c["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert "privileged" not in security
    headless = one(default, "Service", "opsd-agent")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["ports"][0]["name"] == "metrics"
    monitor = one(default, "PodMonitor", "opsd-agent")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics"
    assert endpoint["honorLabels"] is True
    assert endpoint["relabelings"][0] == {
        "sourceLabels": ["__meta_kubernetes_pod_node_name"],
        "targetLabel": "node",
        "action": "replace",
    }
    assert (
        monitor["spec"]["selector"]["matchLabels"].items()
        <= daemonset["spec"]["template"]["metadata"]["labels"].items()
    )


def test_agent_with_custom_values(renders: dict[Combo, list[Obj]]) -> None:
    docs = renders[Combo("agent-custom-values.yaml", "1.29.0", True)]
    daemonset = one(docs, "DaemonSet", "trainops-agent")
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["tolerations"] == values_of("agent-custom-values.yaml")["agent"]["tolerations"]
    assert pod["nodeSelector"] == {"cloud.example.com/pool": "h100"}
    assert pod["runtimeClassName"] == "nvidia"
    assert daemonset["spec"]["updateStrategy"]["rollingUpdate"] == {"maxUnavailable": "10%"}
    run = next(v for v in pod["volumes"] if v["name"] == "run")
    assert run["hostPath"] == {"path": "/var/run/opsd", "type": "DirectoryOrCreate"}  # transport: hostPath
    c = container(daemonset)
    assert next(m for m in c["volumeMounts"] if m["name"] == "run")["mountPath"] == "/run/opsd"
    assert c["ports"] == [{"name": "metrics", "containerPort": 9464, "protocol": "TCP"}]  # no host port
    assert env(c)["OPSD_AGENT_CONTROLLER_URL"]["value"] == "http://trainops-controller:8470/v1/heartbeat"
    assert env(c)["PYTHONFAULTHANDLER"]["value"] == "1"
    settings = yaml.safe_load(one(docs, "ConfigMap", "trainops-config")["data"]["opsd.yaml"])
    assert settings["agent"]["heartbeat_interval_s"] == 2
    assert settings["agent"]["gpu_interval_s"] == 10
    assert settings["agent"]["gpu_source"] == "nvml"
    assert settings["controller"]["kubernetes"]["node_selector"] == "cloud.example.com/pool=h100"
    assert (settings["agent"]["socket"], settings["agent"]["policy_file"]) == (
        "/run/opsd/agent.sock",
        "/run/opsd/policy.json",
    )
    assert "datagram_port" not in settings["agent"]


def test_the_gpu_nodes_are_one_setting(helm: Helm) -> None:
    """gpuNodeSelector is both the agents' nodeSelector and the nodes the controller manages; the controller's own
    key is refused, so that the two cannot disagree."""
    docs = helm.render("--set-json", 'gpuNodeSelector={"nvidia.com/gpu.present": null, "pool": "a", "gen": "h100"}')
    assert one(docs, "DaemonSet")["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "a", "gen": "h100"}
    settings = yaml.safe_load(one(docs, "ConfigMap", "opsd-config")["data"]["opsd.yaml"])
    assert settings["controller"]["kubernetes"]["node_selector"] == "gen=h100,pool=a"
    every = helm.render("--set-json", 'gpuNodeSelector={"nvidia.com/gpu.present": null}')
    assert "nodeSelector" not in one(every, "DaemonSet")["spec"]["template"]["spec"]
    every_settings = yaml.safe_load(one(every, "ConfigMap", "opsd-config")["data"]["opsd.yaml"])
    assert every_settings["controller"]["kubernetes"]["node_selector"] == ""
    proc = helm.template("--set", "controller.config.kubernetes.node_selector=pool=b")
    assert proc.returncode != 0
    assert "the GPU nodes are gpuNodeSelector" in proc.stderr


GPU_ACCESS = {
    "runtime": "default",
    "privileged": "kube-prometheus-stack-values.yaml",
    "hostDriver": "postgres-ha-values.yaml",
}


@pytest.mark.parametrize("access", sorted(GPU_ACCESS))
def test_each_gpu_access_renders_an_agent_the_api_server_accepts(renders: dict[Combo, list[Obj]], access: str) -> None:
    """agent.gpuAccess is the one value: the NVIDIA runtime, a privileged container (without the
    allowPrivilegeEscalation: false the API server refuses beside it), or the host's driver mounted."""
    values = GPU_ACCESS[access]
    assert values_of(values).get("agent", {}).get("gpuAccess", "runtime") == access
    daemonset = one(renders[Combo(values, "1.37.0", True)], "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    assert api_refusals(pod) == []
    c = container(daemonset)  # (kubernetes-validate --strict checks it with the matrix)
    security, variables = c["securityContext"], env(c)
    assert variables["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert security["readOnlyRootFilesystem"] is True
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    if access == "runtime":
        assert security["allowPrivilegeEscalation"] is False
        assert security["capabilities"] == {"drop": ["ALL"]}
        assert "privileged" not in security
    else:
        assert security["privileged"] is True
        assert "allowPrivilegeEscalation" not in security
        assert "capabilities" not in security
    if access == "hostDriver":
        assert volumes["nvidia-driver"]["hostPath"] == {"path": "/home/kubernetes/bin/nvidia", "type": "Directory"}
        assert mounts["nvidia-driver"] == {"name": "nvidia-driver", "mountPath": "/usr/local/nvidia", "readOnly": True}
        assert variables["LD_LIBRARY_PATH"]["value"] == "/usr/local/nvidia/lib64"
    else:
        assert "nvidia-driver" not in volumes
        assert "LD_LIBRARY_PATH" not in variables


def test_a_privileged_agent_set_by_hand_is_refused(helm: Helm) -> None:
    """agent.securityContext.privileged beside the default allowPrivilegeEscalation: false is what the API server
    refuses (the check below proves it); the chart refuses it first and names the value to use."""
    proc = helm.template("--set", "agent.securityContext.privileged=true")
    assert proc.returncode != 0
    assert 'set agent.gpuAccess to \\"privileged\\"' in proc.stderr or "set agent.gpuAccess to" in proc.stderr
    merged = {
        "containers": [{"name": "agent", "securityContext": {"privileged": True, "allowPrivilegeEscalation": False}}]
    }
    assert api_refusals(merged) == [
        "containers[agent]: cannot set allowPrivilegeEscalation to false and privileged to true"
    ]


def test_no_agent_values(renders: dict[Combo, list[Obj]]) -> None:
    docs = renders[Combo("no-agent-values.yaml", "1.37.0", True)]
    kinds = {d["kind"] for d in docs}
    assert not kinds & {"DaemonSet", "PodDisruptionBudget", "PersistentVolumeClaim", "PodMonitor"}
    assert [s["metadata"]["name"] for s in objects(docs, "Service")] == ["opsd-controller"]
    assert [c["metadata"]["name"] for c in objects(docs, "ConfigMap")] == ["opsd-config"]  # no dashboards
    controller = one(docs, "StatefulSet")
    state = next(v for v in controller["spec"]["template"]["spec"]["volumes"] if v["name"] == "state")
    assert state == {"name": "state", "emptyDir": {}}
    assert "AGENT_METRICS" not in env(one(docs, "Pod")["spec"]["containers"][0])


def test_postgresql_with_existing_secrets(renders: dict[Combo, list[Obj]]) -> None:
    docs = renders[Combo("postgres-ha-values.yaml", "1.29.0", False)]
    assert objects(docs, "Secret") == []  # every credential comes from an existing Secret
    assert objects(docs, "PersistentVolumeClaim") == []
    controller = one(docs, "StatefulSet")
    spec = controller["spec"]
    assert spec["replicas"] == 2
    assert spec["updateStrategy"]["type"] == "RollingUpdate"  # one replica at a time: the other serves
    c = container(controller)
    assert c["image"] == "registry.example.com/ml/opsd@sha256:" + "0123456789abcdef" * 4
    assert spec["template"]["spec"]["imagePullSecrets"] == [{"name": "registry-credentials"}]
    assert secret_ref(c, "OPSD_STATE_URL") == ("opsd-db", "dsn")
    assert secret_ref(c, "OPSD_TOKEN") == ("opsd-api", "operator-token")
    assert secret_ref(c, "OPSD_CONTROLLER_READER_TOKEN") == ("opsd-api", "reader-token")
    assert secret_ref(c, "AWS_ACCESS_KEY_ID") == ("opsd-s3", "AWS_ACCESS_KEY_ID")
    assert secret_ref(c, "AWS_SECRET_ACCESS_KEY") == ("opsd-s3", "AWS_SECRET_ACCESS_KEY")
    assert secret_ref(c, "AWS_ENDPOINT_URL_S3") == ("opsd-s3", "AWS_ENDPOINT_URL_S3")
    assert env(c)["AWS_ENDPOINT_URL_S3"]["valueFrom"]["secretKeyRef"]["optional"] is True
    state = next(v for v in spec["template"]["spec"]["volumes"] if v["name"] == "state")
    assert state == {"name": "state", "emptyDir": {}}
    daemonset = one(docs, "DaemonSet")
    assert secret_ref(container(daemonset), "OPSD_CONTROLLER_TOKEN") == ("opsd-api", "agent-token")
    agent_pod = daemonset["spec"]["template"]["spec"]
    assert (agent_pod["hostNetwork"], agent_pod["dnsPolicy"]) == (True, "ClusterFirstWithHostNet")
    assert [(p["containerPort"], p["protocol"]) for p in container(daemonset)["ports"]] == [
        (19464, "TCP"),
        (19465, "UDP"),
    ]
    agent_settings = yaml.safe_load(one(docs, "ConfigMap", "opsd-config")["data"]["opsd.yaml"])["agent"]
    assert (agent_settings["metrics_port"], agent_settings["datagram_port"]) == (19464, 19465)
    assert env(one(docs, "Pod")["spec"]["containers"][0])["AGENTS"]["value"] == "opsd-agent:19464"
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"] == {"minAvailable": 1, "selector": pdb["spec"]["selector"]}
    settings = yaml.safe_load(one(docs, "ConfigMap", "opsd-config")["data"]["opsd.yaml"])
    assert settings["controller"]["detection"] == {"heartbeat_floor_s": 20, "hang_floor_s": 300}
    assert settings["controller"]["tick_interval_s"] == 0.5  # the defaults stay under what the values change


def test_sqlite_with_secrets_from_values(renders: dict[Combo, list[Obj]]) -> None:
    docs = renders[Combo("sqlite-persistence-values.yaml", "1.37.0", False)]
    secrets = {s["metadata"]["name"]: s for s in objects(docs, "Secret")}
    assert set(secrets) == {"opsd-gpuops-credentials", "opsd-gpuops-s3"}  # nameOverride: <release>-<name>
    decoded = {k: base64.b64decode(v).decode() for k, v in secrets["opsd-gpuops-s3"]["data"].items()}
    assert decoded == {
        "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE",
        "AWS_SECRET_ACCESS_KEY": "example-secret",
        "AWS_ENDPOINT_URL_S3": "http://minio.storage.svc:9000",
    }
    tokens = {k: base64.b64decode(v).decode() for k, v in secrets["opsd-gpuops-credentials"]["data"].items()}
    assert tokens == {role: f"not-a-real-{role}-token" for role in ("operator", "reader", "agent", "metrics")}
    assert not objects(docs, "Job")  # the tokens are given: no hook makes them
    c = container(one(docs, "StatefulSet", "opsd-gpuops-controller"))
    assert secret_ref(c, "OPSD_TOKEN") == ("opsd-gpuops-credentials", "operator")
    assert secret_ref(c, "AWS_SECRET_ACCESS_KEY") == ("opsd-gpuops-s3", "AWS_SECRET_ACCESS_KEY")
    assert c["args"][-2:] == ["--log-level", "DEBUG"]
    pvc = one(docs, "PersistentVolumeClaim", "opsd-gpuops-state")
    assert pvc["spec"]["storageClassName"] == "fast-ssd"
    assert pvc["spec"]["resources"]["requests"]["storage"] == "20Gi"
    assert pvc["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    settings = yaml.safe_load(one(docs, "ConfigMap", "opsd-gpuops-config")["data"]["opsd.yaml"])
    assert settings["controller"]["kubernetes"]["lease_name"] == "opsd-lock"


def rolling(docs: list[Obj]) -> dict[str, str]:
    """The credentials' checksum on each workload's pods (a change rolls them)."""
    return {
        d["kind"]: d["spec"]["template"]["metadata"]["annotations"]["checksum/credentials"]
        for d in docs
        if d["kind"] in ("StatefulSet", "DaemonSet")
    }


TOKENS = [f"--set=auth.tokens.{role}={role}-secret-1" for role in ("operator", "reader", "agent", "metrics")]


def test_no_token_in_the_renders_and_a_hook_makes_them_once(helm: Helm, kube: KubeEmulator, tmp_path: Path) -> None:
    """Without tokens the manifests hold none: two renders are the same, byte for byte; the pre-install hook Job makes
    the Secret, and its command, run here on the emulated API server, makes it once and keeps it."""
    first, second = helm.template(), helm.template()
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout
    docs = parse(first.stdout)
    assert [s["metadata"]["name"] for s in objects(docs, "Secret")] == []  # no credentials, no other Secret
    job = one(docs, "Job", "opsd-credentials")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert violations(job["spec"]["template"]["spec"], "restricted") == []
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["command"][:3] == ["python", "-m", "opsd.backends.kubernetes.credentials"]
    kube.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    config = ["--kubeconfig", str(kubeconfig(kube, tmp_path / "kubeconfig"))]
    assert credentials_main([*c["command"][3:], *config]) == 0  # helm install
    made = kube.get("secrets", NAMESPACE, "opsd-credentials")
    assert made is not None
    assert credentials_main([*c["command"][3:], *config]) == 0  # helm upgrade
    assert kube.get("secrets", NAMESPACE, "opsd-credentials")["data"] == made["data"]  # type: ignore[index]
    assert secret_ref(container(one(docs, "DaemonSet")), "OPSD_CONTROLLER_TOKEN") == ("opsd-credentials", "agent")
    assert secret_ref(container(one(docs, "StatefulSet")), "OPSD_TOKEN") == ("opsd-credentials", "operator")
    assert set(made["data"]) == {"operator", "reader", "agent", "metrics"}
    bumped = parse(helm.template("--set", "auth.generation=2").stdout)
    assert rolling(bumped) != rolling(docs)  # a new generation: new tokens, the pods roll onto them
    command = container(one(bumped, "Job"))["command"]
    assert command[command.index("--generation") + 1] == "2"


def test_tokens_given_render_the_same_secret_twice_and_a_change_rolls_the_pods(helm: Helm) -> None:
    first, second = helm.render(*TOKENS), helm.render(*TOKENS)
    secret = one(first, "Secret", "opsd-credentials")
    assert secret == one(second, "Secret", "opsd-credentials")
    assert base64.b64decode(secret["data"]["reader"]).decode() == "reader-secret-1"
    assert not objects(first, "Job")
    assert rolling(first) == rolling(second)
    changed = helm.render(*TOKENS[:2], "--set=auth.tokens.agent=agent-secret-2", TOKENS[3])
    assert set(rolling(changed)) == {"StatefulSet", "DaemonSet"}
    for kind, checksum in rolling(changed).items():
        assert checksum != rolling(first)[kind], kind
    existing = helm.render("--set", "auth.existingSecret=ours")
    assert not objects(existing, "Job")
    assert secret_ref(container(one(existing, "StatefulSet")), "OPSD_TOKEN") == ("ours", "operator")
    assert rolling(helm.render("--set", "auth.existingSecret=ours", "--set", "auth.generation=2")) != rolling(existing)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["--set", "auth.tokens.operator=x"], "give all four tokens", id="one-of-four"),
        pytest.param([*TOKENS[:3], "--set=auth.tokens.metrics=agent-secret-1"], "a token of its own", id="shared"),
        pytest.param([*TOKENS, "--set", "auth.existingSecret=ours"], "both set", id="both"),
    ],
)
def test_credentials_refusals(helm: Helm, args: list[str], message: str) -> None:
    proc = helm.template(*args)
    assert proc.returncode != 0
    assert message in proc.stderr


def test_network_policies_let_in_what_the_pods_serve(default: list[Obj], renders: dict[Combo, list[Obj]]) -> None:
    controller = one(default, "NetworkPolicy", "opsd-controller")["spec"]
    (api,) = controller["ingress"]
    assert api["ports"] == [{"port": "http", "protocol": "TCP"}, {"port": "liveness", "protocol": "UDP"}]
    assert api["from"] == [
        {"podSelector": {}},  # the release namespace: agents, helm test, the other replica
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},  # Prometheus
    ]
    agent = one(default, "NetworkPolicy", "opsd-agent")["spec"]
    ranks, prometheus = agent["ingress"]
    assert ranks["ports"] == [{"port": "metrics", "protocol": "TCP"}, {"port": "datagrams", "protocol": "UDP"}]
    assert {"namespaceSelector": {}} in ranks["from"]  # the training pods, wherever they run (networkPolicy.ranksFrom)
    assert prometheus["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    names = {p["name"] for p in container(one(default, "DaemonSet"))["ports"]}
    assert {p["port"] for rule in agent["ingress"] for p in rule["ports"]} <= names  # named ports that exist
    assert agent["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "agent"
    production = renders[Combo("postgres-ha-values.yaml", "1.37.0", True)]
    assert [p["metadata"]["name"] for p in objects(production, "NetworkPolicy")] == ["opsd-controller"]  # hostNetwork
    (api,) = one(production, "NetworkPolicy")["spec"]["ingress"]
    assert {"ipBlock": {"cidr": "10.128.0.0/16"}} in api["from"]  # the nodes' addresses: the agents
    assert objects(renders[Combo("default", "1.29.0", False)], "NetworkPolicy")


def test_the_api_over_https(renders: dict[Combo, list[Obj]], helm: Helm) -> None:
    docs = renders[Combo("postgres-ha-values.yaml", "1.37.0", True)]
    c = container(one(docs, "StatefulSet"))
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"]["scheme"] == "HTTPS", probe
    settings = yaml.safe_load(one(docs, "ConfigMap", "opsd-config")["data"]["opsd.yaml"])["controller"]
    assert (settings["tls_certfile"], settings["tls_keyfile"]) == ("/etc/opsd/tls/tls.crt", "/etc/opsd/tls/tls.key")
    volumes = {v["name"]: v for v in one(docs, "StatefulSet")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"] == {"secretName": "opsd-tls"}
    agent = container(one(docs, "DaemonSet"))
    assert env(agent)["OPSD_AGENT_CONTROLLER_URL"]["value"] == "https://opsd-controller:8470/v1/heartbeat"
    assert env(agent)["SSL_CERT_FILE"]["value"] == "/etc/opsd/tls/ca.crt"  # trusted by the agent's Python
    (endpoint,) = one(docs, "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {
        "serverName": "opsd-controller",
        "ca": {"secret": {"name": "opsd-tls", "key": "ca.crt"}},
    }
    assert env(one(docs, "Pod")["spec"]["containers"][0])["CONTROLLER_URL"]["value"] == "https://opsd-controller:8470"
    proc = helm.template("--set", "controller.tls.enabled=true")
    assert proc.returncode != 0
    assert "controller.tls.enabled needs controller.tls.secretName" in proc.stderr


def test_dashboards_and_rules_are_the_repository_files(default: list[Obj]) -> None:
    dashboards = {
        d["metadata"]["name"]: d
        for d in objects(default, "ConfigMap")
        if d["metadata"]["name"].startswith("opsd-dashboard-")
    }
    files = sorted(DASHBOARDS.glob("*.json"))
    assert sorted(dashboards) == [f"opsd-dashboard-{f.stem}" for f in files]
    for f in files:
        config_map = dashboards[f"opsd-dashboard-{f.stem}"]
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert config_map["data"] == {f.name: f.read_text()}, f.name  # byte for byte
    rule = one(default, "PrometheusRule", "opsd")
    assert rule["spec"] == yaml.safe_load(RULES.read_text())


def test_monitoring_values_for_kube_prometheus_stack(renders: dict[Combo, list[Obj]]) -> None:
    docs = renders[Combo("kube-prometheus-stack-values.yaml", "1.37.0", True)]
    service_monitor = one(docs, "ServiceMonitor")
    assert service_monitor["metadata"]["labels"]["release"] == "kps"
    (endpoint,) = service_monitor["spec"]["endpoints"]
    assert (endpoint["interval"], endpoint["scrapeTimeout"], endpoint["honorLabels"]) == ("15s", "5s", True)
    assert endpoint["metricRelabelings"] == [{"sourceLabels": ["__name__"], "regex": "go_.*", "action": "drop"}]
    pod_monitor = one(docs, "PodMonitor")
    assert pod_monitor["metadata"]["labels"]["release"] == "kps"
    assert pod_monitor["metadata"]["labels"]["team"] == "ml-infra"
    (pod_endpoint,) = pod_monitor["spec"]["podMetricsEndpoints"]
    assert pod_endpoint["interval"] == "10s"
    assert [r["targetLabel"] for r in pod_endpoint["relabelings"]] == ["node", "zone"]
    rule = one(docs, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kps"
    assert rule["metadata"]["labels"]["role"] == "alert-rules"
    for d in objects(docs, "ConfigMap"):
        if d["metadata"]["name"].startswith("opsd-dashboard-"):
            assert d["metadata"]["namespace"] == "monitoring"
            assert d["metadata"]["annotations"] == {
                "grafana_folder": "opsd",
                "k8s-sidecar-target-directory": "/tmp/dashboards/opsd",
            }


def test_dashboard_label_is_configurable(helm: Helm) -> None:
    docs = helm.render(
        "--set", "monitoring.dashboards.label=dashboards", "--set-string", "monitoring.dashboards.labelValue=opsd"
    )
    dashboards = [d for d in objects(docs, "ConfigMap") if d["metadata"]["name"].startswith("opsd-dashboard-")]
    assert dashboards
    for d in dashboards:
        assert d["metadata"]["labels"]["dashboards"] == "opsd"
        assert "grafana_dashboard" not in d["metadata"]["labels"]


def test_helm_test_pod(default: list[Obj]) -> None:
    pod = one(default, "Pod", "opsd-test")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (c,) = pod["spec"]["containers"]
    assert c["image"] == "opsd:0.1.0"
    assert env(c)["CONTROLLER_URL"]["value"] == "http://opsd-controller:8470"
    assert env(c)["AGENTS"]["value"] == "opsd-agent:9464"  # the headless Service: every ready agent
    assert c["command"] == ["python", "-c"]
    assert pod["spec"]["restartPolicy"] == "Never"


def run_check(script: str, controller_url: str, agents: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "CONTROLLER_URL": controller_url, "AGENTS": agents},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_helm_test_pods_check_reads_the_controller_and_every_agents_gpus(default: list[Obj], tmp_path: Path) -> None:
    """The check the test pod runs, run here against a real controller API and real agents on loopback: an agent that
    reads its GPUs passes; one without NVML (this machine has none) fails the test, naming its node and why."""
    (c,) = one(default, "Pod", "opsd-test")["spec"]["containers"]
    script = c["args"][0]
    port = free_port()
    server = start_api(Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}")), "t", "127.0.0.1", port)
    seeing = Agent(AgentConfig(socket=str(tmp_path / "a.sock"), metrics_port=0, node="n1", gpu_source="none"))
    blind = Agent(AgentConfig(socket=str(tmp_path / "b.sock"), metrics_port=0, node="n2", gpu_source="nvml"))
    seeing.start()
    blind.start()
    try:
        controller_url = f"http://127.0.0.1:{port}"
        ok = run_check(script, controller_url, f"127.0.0.1:{seeing.metrics_port}")
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert ok.stdout.splitlines() == [
            "controller /healthz: OK",
            "controller API without a token: refused",
            "agent n1: 0 GPU(s) through none",
            "1 agent(s): OK",
        ]
        assert blind.gpu_access is not None
        if blind.gpu_access.status.available:
            pytest.skip("NVML loads on this machine: no agent here is without GPUs")
        failed = run_check(script, controller_url, f"127.0.0.1:{blind.metrics_port}")
        assert failed.returncode != 0
        assert "agent n2: no GPU through nvml: library_not_found" in failed.stdout
        assert "1 of 1 agents cannot read their GPUs (n2): set agent.gpuAccess" in failed.stderr
    finally:
        seeing.stop()
        blind.stop()
        server.should_exit = True


def test_notes_render(helm: Helm) -> None:
    proc = helm.run("install", "--namespace", NAMESPACE, "--dry-run=client")
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "port-forward svc/opsd-controller 8470:8470" in notes
    assert "helm test opsd -n opsd" in notes


# -- refusals ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", sorted(MONITORING_KINDS))
def test_forced_monitoring_without_the_api_fails(helm: Helm, key: str) -> None:
    forced = ("--set", f"monitoring.{key}.enabled=true")
    proc = helm.template(*forced, api=False)
    assert proc.returncode != 0
    assert f"monitoring.{key}.enabled is true" in proc.stderr
    assert MONITORING_API in proc.stderr
    kinds = {d["kind"] for d in helm.render(*forced, api=True)}
    assert MONITORING_KINDS[key] in kinds
    kinds = {d["kind"] for d in helm.render("--set", f"monitoring.{key}.enabled=false", api=True)}
    assert MONITORING_KINDS[key] not in kinds


def test_more_than_one_controller_needs_postgresql(helm: Helm) -> None:
    proc = helm.template("--set", "controller.replicas=2")
    assert proc.returncode != 0
    assert "controller.replicas is 2" in proc.stderr
    assert "postgresql.url or postgresql.existingSecret" in proc.stderr
    postgresql = ("--set", "postgresql.url=postgresql+psycopg://opsd@db/opsd")
    assert one(helm.render("--set", "controller.replicas=2", *postgresql), "StatefulSet")["spec"]["replicas"] == 2
    proc = helm.template(
        "--set", "controller.replicas=2", *postgresql, "--set", "controller.leaderElection.enabled=false"
    )
    assert proc.returncode != 0
    assert "leader election" in proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(
            ["--set", "controller.replicas=two"], "at '/controller/replicas': got string, want integer", id="int"
        ),
        pytest.param(["--set-string", "agent.enabled=yes"], "at '/agent/enabled': got string, want boolean", id="bool"),
        pytest.param(
            ["--set", "monitoring.serviceMonitor.enabled=sometimes"], "/monitoring/serviceMonitor/enabled", id="auto"
        ),
        pytest.param(["--set", "image.pullPolicy=Sometimes"], "/image/pullPolicy", id="enum"),
        pytest.param(["--set", "agent.tolerations[0].operator=Maybe"], "/agent/tolerations/0/operator", id="list"),
        pytest.param(
            ["--set", "monitoring.podMonitor.interval=15 seconds"], "/monitoring/podMonitor/interval", id="duration"
        ),
        pytest.param(["--set", "replicas=2"], "additional properties 'replicas' not allowed", id="unknown-top"),
        pytest.param(
            ["--set", "controller.replica=2"],
            "at '/controller': additional properties 'replica' not allowed",
            id="unknown-nested",
        ),
        pytest.param(
            ["--set", "monitoring.podMonitor.intervall=15s"],
            "additional properties 'intervall' not allowed",
            id="unknown-deep",
        ),
        pytest.param(
            ["--set", "agent.serviceAccount.automount=true"],
            "additional properties 'automount' not allowed",
            id="unknown-agent",
        ),
    ],
)
def test_schema_refuses_bad_values(helm: Helm, args: list[str], message: str) -> None:
    lint = helm.run("lint", "--strict", *args)
    assert lint.returncode != 0
    assert message in lint.stdout + lint.stderr
    template = helm.template(*args)
    assert template.returncode != 0
    assert message in template.stderr


def test_kube_version_below_the_floor_is_refused(helm: Helm) -> None:
    proc = helm.template(kube="1.28.9")
    assert proc.returncode != 0
    assert "chart requires kubeVersion: >=1.29.0-0" in proc.stderr


# -- names -------------------------------------------------------------------------------------------------------------


def test_name_override(helm: Helm) -> None:
    docs = helm.render("--set", "nameOverride=gpu-ops")
    assert {d["metadata"]["labels"]["app.kubernetes.io/name"] for d in docs} == {"gpu-ops"}
    one(docs, "StatefulSet", "opsd-gpu-ops-controller")
    one(docs, "DaemonSet", "opsd-gpu-ops-agent")
    one(docs, "Job", "opsd-gpu-ops-credentials")


def test_fullname_override(helm: Helm) -> None:
    docs = helm.render("--set", "fullnameOverride=trainops")
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert all(name.startswith("trainops") for _, name in names), names
    assert ("StatefulSet", "trainops-controller") in names
    assert ("ClusterRole", "trainops-controller") in names
    assert ("Role", "trainops-leader-election") in names
    settings = yaml.safe_load(one(docs, "ConfigMap", "trainops-config")["data"]["opsd.yaml"])
    assert settings["controller"]["kubernetes"]["lease_name"] == "trainops-leader"
    c = container(one(docs, "DaemonSet", "trainops-agent"))
    assert env(c)["OPSD_AGENT_CONTROLLER_URL"]["value"] == "http://trainops-controller:8470/v1/heartbeat"
    assert {d["metadata"]["labels"]["app.kubernetes.io/name"] for d in docs} == {"opsd"}


def test_release_name_without_the_chart_name(helm: Helm) -> None:
    proc = helm.run("template", "--namespace", "ml", release="prod")
    assert proc.returncode == 0, proc.stderr
    docs = parse(proc.stdout)
    one(docs, "StatefulSet", "prod-opsd-controller")
    binding = one(docs, "ClusterRoleBinding", "prod-opsd-controller")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "prod-opsd-controller", "namespace": "ml"}]


# -- the chart's files -------------------------------------------------------------------------------------------------


def test_chart_metadata() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["apiVersion"] == "v2"
    assert chart["appVersion"] == project["version"] == "0.1.0"
    assert chart["kubeVersion"] == ">=1.29.0-0"


# Kubernetes types the values pass through as they are: the API server (and kubernetes-validate, above) checks them.
PASSED_THROUGH = (
    "/nodeAffinity",
    "/podAffinity",
    "/podAntiAffinity",
    "/httpGet",
    "/tcpSocket",
    "/exec",
    "/grpc",
    "/seLinuxOptions",
    "/seccompProfile",
    "/appArmorProfile",
    "/windowsOptions",
    "/valueFrom",
    "/sysctls/items",
    "/claims/items",
    "/topologySpreadConstraints/items",
    "/podSelector",  # NetworkPolicy peers' label selectors
    "/namespaceSelector",
)
FREE_OBJECTS = (
    "/properties/global",
    "/properties/controller/properties/config",  # opsd validates its own settings
    "/properties/agent/properties/config",
)


def test_values_schema_is_strict_throughout() -> None:
    """Every object of the values schema lists its keys and refuses others, or is a map of typed values; the only
    free objects are the settings maps, `global`, and Kubernetes types passed through."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    loose: list[str] = []

    def walk(node: Any, where: str) -> None:
        if isinstance(node, dict):
            if node.get("type") == "object":
                free = where in FREE_OBJECTS or where.endswith(PASSED_THROUGH)
                if "properties" in node and node.get("additionalProperties") is not False:
                    loose.append(where)  # lists its keys but lets others in
                if "properties" not in node and not isinstance(node.get("additionalProperties"), dict) and not free:
                    loose.append(where)  # takes anything
            for key, sub in node.items():
                walk(sub, f"{where}/{key}")
        elif isinstance(node, list):
            for i, sub in enumerate(node):
                walk(sub, f"{where}/{i}")

    walk(schema, "")
    assert loose == []
    assert schema["additionalProperties"] is False
    jsonschema.Draft202012Validator(schema).validate(yaml.safe_load((CHART / "values.yaml").read_text()))


def test_chart_yaml_passes_yamllint() -> None:
    config = YamlLintConfig(file=str(CHART / ".yamllint"))
    files = [CHART / "Chart.yaml", CHART / "values.yaml", *sorted((CHART / "ci").glob("*.yaml")), JOBSET_EXAMPLE]
    problems = [
        f"{path.relative_to(ROOT)}:{p.line}:{p.column}: {p.message} ({p.rule})"
        for path in files
        for p in yamllint_linter.run(path.read_text(), config, str(path))
    ]
    assert problems == []


def chart_copy() -> dict[str, bytes]:
    """What helm/opsd/files/dashboards must hold: dashboards/*.json and the alert rules, byte for byte."""
    expected = {p.name: p.read_bytes() for p in DASHBOARDS.glob("*.json")}
    expected["rules/opsd.rules.yaml"] = RULES.read_bytes()
    return expected


def test_the_chart_carries_its_own_copy_of_the_dashboards_and_rules() -> None:
    """No link out of the chart: its files are its own, equal to the repository's (`make chart-files` copies them)."""
    files = CHART / "files" / "dashboards"
    assert not [p for p in CHART.rglob("*") if p.is_symlink()]
    copied = {p.relative_to(files).as_posix(): p.read_bytes() for p in files.rglob("*") if p.is_file()}
    assert copied == chart_copy(), "helm/opsd/files/dashboards differs from dashboards/: run `make chart-files`"


def test_the_packaged_chart_renders_alone(helm: Helm, tmp_path: Path) -> None:
    """`helm package`, then the archive alone (copied away from the repository) lints and renders, with the
    dashboards and rules inside it."""
    proc = helm.run("package", "--destination", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    (built,) = (tmp_path / "out").glob("opsd-*.tgz")
    alone = tmp_path / "elsewhere" / built.name
    alone.parent.mkdir()
    shutil.copy(built, alone)
    with tarfile.open(alone) as tar:
        names = tar.getnames()
        packaged = {
            m.name.removeprefix("opsd/files/dashboards/"): tar.extractfile(m).read()  # type: ignore[union-attr]
            for m in tar.getmembers()
            if m.name.startswith("opsd/files/dashboards/") and m.isfile()
        }
    assert packaged == chart_copy()
    assert not [n for n in names if n.endswith((".yamllint", ".test.yaml"))]
    lint = helm.run("lint", "--strict", *API_ARGS, chart=alone)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    proc = helm.template(chart=alone)
    assert proc.returncode == 0, proc.stderr
    docs = parse(proc.stdout)
    assert one(docs, "PrometheusRule")["spec"] == yaml.safe_load(RULES.read_text())
    dashboards = {d["metadata"]["name"] for d in objects(docs, "ConfigMap") if "-dashboard-" in d["metadata"]["name"]}
    assert dashboards == {f"opsd-dashboard-{p.stem}" for p in DASHBOARDS.glob("*.json")}


def test_kubernetes_validate_refuses_unknown_fields() -> None:
    """The strict schemas are really in use: a misspelt field of a built-in object is an error."""
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "x"},
        "spec": {
            "replica": 1,
            "selector": {"matchLabels": {"a": "b"}},
            "template": {"metadata": {"labels": {"a": "b"}}, "spec": {"containers": [{"name": "c", "image": "i"}]}},
        },
    }
    with pytest.raises(kubernetes_validate.ValidationError, match="replica"):
        kubernetes_validate.validate(deployment, "1.37", strict=True)


def test_crd_schemas_refuse_unknown_fields(default: list[Obj]) -> None:
    monitor = json.loads(json.dumps(one(default, "ServiceMonitor")))
    monitor["spec"]["endpoints"][0]["intervall"] = "30s"
    assert any("intervall" in e for e in crd_errors(monitor))
    rule = json.loads(json.dumps(one(default, "PrometheusRule")))
    rule["spec"]["groups"][0]["rules"][0]["for"] = "15 minutes"
    assert crd_errors(rule)


# -- the image ---------------------------------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines = [line for line in (ROOT / "Dockerfile").read_text().splitlines() if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in text.splitlines():
        if line.strip():
            instruction, _, rest = line.strip().partition(" ")
            out.append((instruction.upper(), " ".join(rest.split())))
    return out


def test_dockerfile_base_image_is_pinned() -> None:
    bases = [args.split()[0] for inst, args in dockerfile_instructions() if inst == "FROM"]
    assert bases
    for base in bases:
        assert re.search(r"@sha256:[0-9a-f]{64}$", base) or re.search(r":\d+\.\d+\.\d+[-\w.]*$", base), base


def test_dockerfile_runs_as_a_non_root_user() -> None:
    users = [args for inst, args in dockerfile_instructions() if inst == "USER"]
    assert users, "no USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")
    assert user.isdigit(), "a numeric USER lets Kubernetes check runAsNonRoot"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["controller"]["podSecurityContext"]["runAsUser"] == int(user)
    entrypoints = [args for inst, args in dockerfile_instructions() if inst == "ENTRYPOINT"]
    assert json.loads(entrypoints[-1]) == ["opsd"]


def test_dockerfile_installs_without_torch_and_with_the_makefile_constraints() -> None:
    runs = " ".join(args for inst, args in dockerfile_instructions() if inst == "RUN")
    installs = re.findall(r"pip install ([^&;]*)", runs)
    assert len(installs) == 1, installs
    words = installs[0].split()
    assert "." in words  # the project itself, no extras
    assert not re.search(r"torch|\[(trainer|dev)\]|\.\[", installs[0]), installs[0]
    assert "--no-cache-dir" in words
    constraints = words[words.index("-c") + 1]
    make_installs = re.findall(r"pip install .*", (ROOT / "Makefile").read_text())
    make_constraints = {m.split()[m.split().index("-c") + 1] for m in make_installs if " -c " in m}
    assert make_constraints == {constraints} == {"constraints.txt"}
    copied = " ".join(args for inst, args in dockerfile_instructions() if inst == "COPY")
    assert constraints in copied.split()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(dep.lower().startswith("torch") for dep in project["dependencies"])


# -- the JobSet example of docs/kubernetes.md --------------------------------------------------------------------------


def test_jobset_example_is_in_the_doc_verbatim() -> None:
    doc = (ROOT / "docs" / "kubernetes.md").read_text()
    blocks = re.findall(r"^```yaml\n(.*?)^```", doc, flags=re.S | re.M)
    example = JOBSET_EXAMPLE.read_text()
    assert example in blocks


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_jobset_example_is_valid(kube: str) -> None:
    jobset = yaml.safe_load(JOBSET_EXAMPLE.read_text())
    assert crd_errors(jobset) == []
    for replicated in jobset["spec"]["replicatedJobs"]:
        # JobSet's CRD embeds batch/v1 JobTemplateSpec: check it as the Job it becomes.
        template = replicated["template"]
        job = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": replicated["name"], **template.get("metadata", {})},
            "spec": template["spec"],
        }
        kubernetes_validate.validate(job, kube, strict=True)
    for rule in jobset["spec"]["failurePolicy"]["rules"]:
        # the JobSet webhook's rule for names (api/jobset/v1alpha2/jobset_types.go)
        assert re.fullmatch(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?", rule["name"])


def test_jobset_example_is_wired_to_opsd() -> None:
    jobset = yaml.safe_load(JOBSET_EXAMPLE.read_text())
    run = jobset["metadata"]["annotations"]["opsd.io/run"]
    policy = jobset["spec"]["failurePolicy"]
    assert policy["maxRestarts"] >= 1
    assert [(r["action"], r["onJobFailureReasons"]) for r in policy["rules"]] == [
        ("RestartJobSetAndIgnoreMaxRestarts", ["PodFailurePolicy"])
    ]
    (replicated,) = jobset["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    assert job["backoffLimit"] == 0
    assert job["podFailurePolicy"]["rules"] == [
        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    ]
    pod = job["template"]
    assert pod["metadata"]["annotations"]["opsd.io/run"] == run
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never"
    # any GPU node, back onto the run's own after a restart; no opsd toleration, no node labelled by hand
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert "tolerations" not in spec
    (preferred,) = spec["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preferred["preference"]["matchExpressions"] == [{"key": "opsd.io/run", "operator": "In", "values": [run]}]
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in spec["affinity"]["nodeAffinity"]
    (c,) = spec["containers"]
    variables = env(c)
    assert variables["OPSD_AGENT_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.hostIP"}}
    assert not {"OPSD_AGENT_SOCKET", "OPSD_POLICY_FILE", "OPSD_FLIGHT_DIR"} & set(variables)
    assert variables["OPSD_RUN"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.annotations['opsd.io/run']"
    launch = variables["OPSD_LAUNCH"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert launch == "metadata.labels['jobset.sigs.k8s.io/restart-attempt']"
    # no host directory: the training namespace can enforce Pod Security "restricted"
    assert not [v for v in spec["volumes"] if "hostPath" in v]
    assert violations(spec, "restricted") == []
    # the chart's agents listen where the pods send (its default host ports)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["agent"]["transport"] == "hostPort"
    assert values["agent"]["hostPorts"] == {"http": 9464, "datagrams": 9465}


def test_the_host_directory_variant_of_the_docs_needs_a_privileged_namespace() -> None:
    """The docs' snippet for agent.transport hostPath, put into the example's pod: valid, and only "privileged"
    admits it (a hostPath)."""
    doc = (ROOT / "docs" / "kubernetes.md").read_text()
    (snippet,) = [b for b in re.findall(r"^```yaml\n(.*?)^```", doc, flags=re.S | re.M) if "OPSD_AGENT_SOCKET" in b]
    container_part, pod_part = snippet.split("              volumes:\n")
    parts = {**yaml.safe_load(textwrap.dedent(container_part)), **yaml.safe_load("volumes:\n" + pod_part)}
    pod = copy.deepcopy(yaml.safe_load(JOBSET_EXAMPLE.read_text())["spec"]["replicatedJobs"][0]["template"]["spec"])
    spec = pod["template"]["spec"]
    (c,) = spec["containers"]
    c["env"] = [e for e in c["env"] if e["name"] != "OPSD_AGENT_HOST"] + parts["env"]
    c["volumeMounts"] += parts["volumeMounts"]
    spec["volumes"] += parts["volumes"]
    kubernetes_validate.validate(
        {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j"}, "spec": pod}, "1.37", strict=True
    )
    assert violations(spec, "baseline") == ["HostPath volumes: volume opsd"]
    assert level_of(spec) == "privileged"
    assert env(c)["OPSD_POLICY_FILE"]["value"] == "/run/opsd/policy.json"


# -- tools/install_helm.py ---------------------------------------------------------------------------------------------


def load_install_helm() -> ModuleType:
    spec = importlib.util.spec_from_file_location("install_helm", ROOT / "tools" / "install_helm.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_install_helm_keeps_a_helm_of_the_pinned_version(helm: Helm, tmp_path: Path) -> None:
    install_helm = load_install_helm()
    version = install_helm.helm_version(Path(helm.path))
    if not install_helm.is_expected(version):
        pytest.skip(f"{helm.path} is {version}, not {install_helm.EXPECTED_VERSION}")
    target = tmp_path / "helm"
    target.symlink_to(helm.path)
    assert "already installed" in install_helm.install(target)
    assert target.is_symlink()  # left alone
    assert not install_helm.is_expected("v3.16.2+g13654a5")
    assert install_helm.is_expected("v4.3.1+gc0d08d0")
