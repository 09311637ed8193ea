"""What the chart renders for the controller (tests/test_helm.py renders it): its RBAC as the backend's calls need it,
its StatefulSet, Service and disruption budget, the settings file opsd reads, its state store and credentials
(PostgreSQL or SQLite, tokens from values, from an existing Secret or made once by a hook), the network policies and
the API over HTTPS."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import pytest
import yaml  # type: ignore[import-untyped]

from opsd.backends.kubernetes.credentials import main as credentials_main
from tests.helm_chart import (
    COMBOS,
    NAMESPACE,
    RELEASE,
    Combo,
    Helm,
    Obj,
    container,
    env,
    objects,
    one,
    parse,
    secret_ref,
)
from tests.kube.emulator import KubeEmulator
from tests.kube.training import kubeconfig
from tests.pod_security import violations


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


RUNS_GRANTS = {  # where the runs are: runNamespaces (the release namespace by default), or every one (clusterWide)
    ("", "pods", ()): ["list", "watch", "delete"],
    ("", "pods/eviction", ()): ["create"],
    ("jobset.x-k8s.io", "jobsets", ()): ["get", "list", "watch"],
    ("", "events", ()): ["create", "get"],
    ("", "secrets", ()): ["create"],  # each run's key, beside its JobSet (agent.rankAuth; never read)
}
NODE_GRANTS = {("", "nodes", ()): ["get", "list", "watch", "update"]}  # replaced whole: no patch
LEADER_GRANTS = {
    ("coordination.k8s.io", "leases", ()): ["create"],
    ("coordination.k8s.io", "leases", ("opsd-leader",)): ["get", "update"],
    ("", "pods", ("opsd-controller-0",)): ["patch"],  # its own pod's opsd.io/role label, and no other pod
}


def test_rbac_grants_what_the_backend_calls(default: list[Obj]) -> None:
    """The rules as tests/test_rbac.py proves them from the calls (the emulated API server's request log)."""
    assert grants(one(default, "ClusterRole", "opsd-controller")) == NODE_GRANTS  # nothing of the runs' cluster-wide
    runs = one(default, "Role", "opsd-controller-runs")
    assert (runs["metadata"]["namespace"], grants(runs)) == (NAMESPACE, RUNS_GRANTS)  # the release namespace's
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


def test_a_controller_may_act_in_the_runs_namespaces_only_unless_cluster_wide_is_asked(helm: Helm) -> None:
    docs = helm.render("--set-json", 'runNamespaces=["training", "research"]')
    assert grants(one(docs, "ClusterRole", "opsd-controller")) == NODE_GRANTS
    runs = [r for r in objects(docs, "Role") if r["metadata"]["name"] == "opsd-controller-runs"]
    assert sorted(r["metadata"]["namespace"] for r in runs) == ["research", "training"]
    assert all(grants(r) == RUNS_GRANTS for r in runs)
    settings = yaml.safe_load(one(docs, "ConfigMap", "opsd-config")["data"]["opsd.yaml"])
    assert settings["controller"]["kubernetes"]["watch_namespace"] == "training,research"  # what it watches
    wide = helm.render("--set", "rbac.clusterWide=true")
    assert grants(one(wide, "ClusterRole", "opsd-controller")) == NODE_GRANTS | RUNS_GRANTS
    assert not [r for r in objects(wide, "Role") if r["metadata"]["name"].endswith("-runs")]
    wide_settings = yaml.safe_load(one(wide, "ConfigMap", "opsd-config")["data"]["opsd.yaml"])
    assert wide_settings["controller"]["kubernetes"]["watch_namespace"] == ""
    proc = helm.template("--set", "controller.config.kubernetes.watch_namespace=x")
    assert proc.returncode != 0
    assert "the runs' namespaces are runNamespaces" in proc.stderr
    docs = helm.render("--set-json", 'runNamespaces=["training"]')
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
    assert grants(one(no_delete, "Role", "opsd-controller-runs"))[("", "pods", ())] == ["list", "watch"]
    no_election = renders[Combo("agent-custom-values.yaml", "1.37.0", True)]
    roles = [r["metadata"]["name"] for r in objects(no_election, "Role")]
    # the runs' namespace's, the node events', the hooks' (credentials, helm test); none for leader election
    assert roles == [
        "trainops-controller-runs",
        "trainops-controller-node-events",
        "trainops-credentials",
        "trainops-test",
    ]
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
        {"name": "heartbeats", "containerPort": 8471, "protocol": "TCP"},  # the heartbeat process
    ]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "http"}, probe
    assert secret_ref(c, "OPSD_TOKEN") == ("opsd-credentials", "operator")  # a token per role of the API
    assert secret_ref(c, "OPSD_CONTROLLER_READER_TOKEN") == ("opsd-credentials", "reader")
    assert secret_ref(c, "OPSD_CONTROLLER_AGENT_TOKEN") == ("opsd-credentials", "agent")
    assert secret_ref(c, "OPSD_CONTROLLER_METRICS_TOKEN") == ("opsd-credentials", "metrics")
    for variable, key in (  # the tokens before the last rotation, while pods not yet rolled hold them
        ("OPSD_CONTROLLER_PREVIOUS_TOKEN", "operator-previous"),
        ("OPSD_CONTROLLER_PREVIOUS_READER_TOKEN", "reader-previous"),
        ("OPSD_CONTROLLER_PREVIOUS_AGENT_TOKEN", "agent-previous"),
        ("OPSD_CONTROLLER_PREVIOUS_METRICS_TOKEN", "metrics-previous"),
    ):
        assert secret_ref(c, variable) == ("opsd-credentials", key)
        assert env(c)[variable]["valueFrom"]["secretKeyRef"]["optional"] is True  # none before the first rotation
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
        {"name": "heartbeats", "port": 8471, "targetPort": "heartbeats", "protocol": "TCP"},  # the one they name too
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
            "heartbeat_port": 8471,
            "tick_interval_s": 0.5,
            "detection": {"heartbeat_floor_s": 10, "hang_floor_s": 60},
            "kubernetes": {
                "namespace": NAMESPACE,
                "watch_namespace": NAMESPACE,  # the runs' namespaces: the release namespace by default
                "node_selector": (  # the default gpuNodeTerms: each platform's GPU label, ORed
                    "nvidia.com/gpu.present=true; cloud.google.com/gke-accelerator;"
                    " feature.node.kubernetes.io/pci-10de.present=true;"
                    " karpenter.k8s.aws/instance-gpu-manufacturer=nvidia;"
                    " eks.amazonaws.com/instance-gpu-manufacturer=nvidia; k8s.amazonaws.com/accelerator"
                ),
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
    command = one(docs, "Pod")["spec"]["containers"][0]["command"]
    assert command[command.index("--agent-port") + 1] == "19464"
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"] == {"minAvailable": 1, "selector": pdb["spec"]["selector"]}
    settings = yaml.safe_load(one(docs, "ConfigMap", "opsd-config")["data"]["opsd.yaml"])
    assert settings["controller"]["detection"] == {"heartbeat_floor_s": 20, "hang_floor_s": 300}
    assert settings["controller"]["tick_interval_s"] == 0.5  # the defaults stay under what the values change


def test_sqlite_with_secrets_from_values(renders: dict[Combo, list[Obj]]) -> None:
    docs = renders[Combo("sqlite-persistence-values.yaml", "1.37.0", False)]
    secrets = {s["metadata"]["name"]: s for s in objects(docs, "Secret")}
    assert set(secrets) == {"opsd-gpuops-tokens", "opsd-gpuops-s3"}  # nameOverride: <release>-<name>
    decoded = {k: base64.b64decode(v).decode() for k, v in secrets["opsd-gpuops-s3"]["data"].items()}
    assert decoded == {
        "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE",
        "AWS_SECRET_ACCESS_KEY": "example-secret",
        "AWS_ENDPOINT_URL_S3": "http://minio.storage.svc:9000",
    }
    tokens = {k: base64.b64decode(v).decode() for k, v in secrets["opsd-gpuops-tokens"]["data"].items()}
    assert tokens == {role: f"not-a-real-{role}-token" for role in ("operator", "reader", "agent", "metrics")}
    assert not objects(docs, "Job")  # the tokens are given: no hook makes them
    c = container(one(docs, "StatefulSet", "opsd-gpuops-controller"))
    assert secret_ref(c, "OPSD_TOKEN") == ("opsd-gpuops-tokens", "operator")
    assert secret_ref(c, "AWS_SECRET_ACCESS_KEY") == ("opsd-gpuops-s3", "AWS_SECRET_ACCESS_KEY")
    assert c["args"][-2:] == ["--log-level", "DEBUG"]
    pvc = one(docs, "PersistentVolumeClaim", "opsd-gpuops-state")
    assert pvc["spec"]["storageClassName"] == "fast-ssd"
    assert pvc["spec"]["resources"]["requests"]["storage"] == "20Gi"
    assert pvc["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    settings = yaml.safe_load(one(docs, "ConfigMap", "opsd-gpuops-config")["data"]["opsd.yaml"])
    assert settings["controller"]["kubernetes"]["lease_name"] == "opsd-lock"


def pod_template(docs: list[Obj], kind: str) -> Obj:
    return dict(one(docs, kind)["spec"]["template"])


@pytest.mark.parametrize(
    ("change", "rolls", "stays"),
    [
        ("--set=controller.config.detection.hang_floor_s=120", "StatefulSet", "DaemonSet"),
        ("--set=agent.config.heartbeat_interval_s=2", "DaemonSet", "StatefulSet"),
    ],
    ids=["controller only", "agent only"],
)
def test_a_change_of_one_components_settings_rolls_that_component_only(
    helm: Helm, default: list[Obj], change: str, rolls: str, stays: str
) -> None:
    """Each workload's pods carry the checksum of their own section of the settings: a controller-only change does
    not roll the agents (an agent roll silences every node's agent in turn), and an agent-only one does not restart
    the controller. The settings file itself holds both sections, as before."""
    changed = helm.render(change)
    assert pod_template(changed, stays) == pod_template(default, stays)
    assert pod_template(changed, rolls) != pod_template(default, rolls)
    before = yaml.safe_load(one(default, "ConfigMap", "opsd-config")["data"]["opsd.yaml"])
    after = yaml.safe_load(one(changed, "ConfigMap", "opsd-config")["data"]["opsd.yaml"])
    assert set(before) == set(after) == {"controller", "agent"}
    assert before != after


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
    assert set(made["data"]) == {"operator", "reader", "agent", "metrics", "ranks"}
    # in no manifest: nothing Argo CD tracks an application's resources by, and told not to prune it
    assert "app.kubernetes.io/instance" not in made["metadata"]["labels"]
    assert made["metadata"]["labels"]["opsd.io/release"] == RELEASE
    assert made["metadata"]["annotations"]["argocd.argoproj.io/sync-options"] == "Prune=false"
    assert made["metadata"]["annotations"]["argocd.argoproj.io/compare-options"] == "IgnoreExtraneous"
    bumped = parse(helm.template("--set", "auth.generation=2").stdout)
    assert rolling(bumped) != rolling(docs)  # a new generation: new tokens, the pods roll onto them
    command = container(one(bumped, "Job"))["command"]
    assert command[command.index("--generation") + 1] == "2"


def test_tokens_given_render_the_same_secret_twice_and_a_change_rolls_the_pods(helm: Helm) -> None:
    first, second = helm.render(*TOKENS), helm.render(*TOKENS)
    secret = one(first, "Secret", "opsd-tokens")  # not the hook's name: a switch on upgrade meets neither
    assert secret == one(second, "Secret", "opsd-tokens")
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
    assert api["ports"] == [
        {"port": "http", "protocol": "TCP"},
        {"port": "liveness", "protocol": "UDP"},
        {"port": "heartbeats", "protocol": "TCP"},
    ]
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
    check = one(docs, "Pod")["spec"]["containers"][0]
    assert check["command"][check["command"].index("--controller") + 1] == "https://opsd-controller:8470"
    assert env(check)["SSL_CERT_FILE"]["value"] == "/etc/opsd/tls/ca.crt"
    proc = helm.template("--set", "controller.tls.enabled=true")
    assert proc.returncode != 0
    assert "controller.tls.enabled needs controller.tls.secretName" in proc.stderr
