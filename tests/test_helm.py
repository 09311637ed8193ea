"""The Helm chart (helm/opsd), rendered by a real helm v4 (`tools/install_helm.py` puts it at .venv/bin/helm): the
matrix, the chart's refusals and its names.

Every values set (the defaults and each helm/opsd/ci/*.yaml) is linted with `helm lint --strict` and rendered with
`helm template` for the lowest and highest Kubernetes versions the chart supports, the renderings with and
without the Prometheus Operator's API (`helm lint` has no --api-versions); each rendering is made once (a session
fixture, tests/conftest.py) and the assertions read the parsed objects. Built-in objects pass kubernetes-validate's
strict schemas of that Kubernetes version; the ServiceMonitor, PodMonitor and PrometheusRule pass the schemas in
tests/schemas/, made from the upstream CRDs. Also here: the values schema refusing bad values, the chart's own
refusals, and the names the overrides give. What the defaults render for each part is in
tests/test_helm_controller.py, tests/test_helm_agent.py and tests/test_helm_monitoring.py; the chart's own files
and the image in tests/test_chart_files.py.
"""

from __future__ import annotations

import functools
import json

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml  # type: ignore[import-untyped]

from tests.helm_chart import (
    API_ARGS,
    COMBOS,
    CRD_SCHEMAS,
    KUBE_VERSIONS,
    MONITORING_API,
    MONITORING_KINDS,
    NAMESPACE,
    RELEASE,
    VALUE_SETS,
    Combo,
    Helm,
    Obj,
    container,
    crd_errors,
    env,
    one,
    parse,
    pod_templates,
    values_args,
    values_of,
)
from tests.pod_security import api_refusals, level_of, violations

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
        elif d["kind"] in ("Role", "RoleBinding") and d["metadata"]["name"].endswith("-controller-node-events"):
            assert ns == "default"  # where a cluster-scoped object's Events live: create, nothing else
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
