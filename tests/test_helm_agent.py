"""What the chart renders for the agent (tests/test_helm.py renders it): its DaemonSet with default and custom
values, the GPU nodes as one setting, each way of reaching the GPUs (``agent.gpuAccess``) in a pod the API server
accepts, and a release without agents."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

from opsd.backends.kubernetes.selectors import NodeSelector
from tests.helm_chart import Combo, Helm, Obj, container, env, objects, one, secret_ref, values_of
from tests.kube.jobset import fits
from tests.pod_security import api_refusals


def test_agent_daemonset(default: list[Obj]) -> None:
    daemonset = one(default, "DaemonSet", "opsd-agent")
    pod = daemonset["spec"]["template"]["spec"]
    c = container(daemonset)
    assert daemonset["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}
    assert "nodeSelector" not in pod  # the GPU nodes are the required node affinity's terms, ORed
    assert pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
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
    assert secret_ref(c, "OPSD_AGENT_PREVIOUS_METRICS_TOKEN") == ("opsd-credentials", "metrics-previous")
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
    # not root: the ports are the node's through hostPort, and the GPUs' device nodes are every user's
    assert (security["runAsUser"], security["runAsGroup"], security["runAsNonRoot"]) == (10001, 10001, True)
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
    selector = NodeSelector.parse(settings["controller"]["kubernetes"]["node_selector"])
    assert len(selector.terms) == 6  # each platform's GPU label, and the pool
    assert selector.matches({"cloud.google.com/gke-accelerator": "nvidia-h100-80gb", "cloud.example.com/pool": "h100"})
    assert not selector.matches({"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"})
    assert (settings["agent"]["socket"], settings["agent"]["policy_file"]) == (
        "/run/opsd/agent.sock",
        "/run/opsd/policy.json",
    )
    assert "datagram_port" not in settings["agent"]


PLATFORM_LABELS = {
    "GPU Operator": {"nvidia.com/gpu.present": "true"},
    "GKE": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
    "NFD": {"feature.node.kubernetes.io/pci-10de.present": "true"},
    "Karpenter": {"karpenter.k8s.aws/instance-gpu-manufacturer": "nvidia"},
    "EKS Auto Mode": {"eks.amazonaws.com/instance-gpu-manufacturer": "nvidia"},
    "EKS node group": {"k8s.amazonaws.com/accelerator": "nvidia-tesla-h100"},
}


def labelled(labels: dict[str, str]) -> dict[str, Any]:
    return {"metadata": {"name": "n", "labels": labels}, "spec": {}}


def test_the_agents_and_the_controller_find_the_gpu_nodes_of_every_platform(helm: Helm) -> None:
    """The default required node affinity admits a node carrying only one platform's GPU label, for each platform,
    and no CPU node; the controller's node_selector, written from the same terms, selects the same nodes."""
    docs = helm.render()
    template = one(docs, "DaemonSet")["spec"]["template"]
    assert "nodeSelector" not in template["spec"]
    settings = yaml.safe_load(one(docs, "ConfigMap", "opsd-config")["data"]["opsd.yaml"])
    selector = NodeSelector.parse(settings["controller"]["kubernetes"]["node_selector"])
    for platform, labels in {**PLATFORM_LABELS, "a CPU node": {"kubernetes.io/os": "linux"}}.items():
        gpu = platform != "a CPU node"
        assert fits(labelled({**labels, "kubernetes.io/os": "linux"}), template) is gpu, platform
        assert selector.matches(labels) is gpu, platform


def test_the_gpu_nodes_are_one_setting(helm: Helm) -> None:
    """gpuNodeTerms (ORed) and gpuNodeSelector (ANDed with each) are both the agents' placement and the nodes the
    controller manages; the controller's own key is refused, so that the two cannot disagree."""
    terms = [{"matchExpressions": [{"key": "gen", "operator": "In", "values": ["h100", "h200"]}]}]
    docs = helm.render("--set-json", f"gpuNodeTerms={json.dumps(terms)}", "--set-json", 'gpuNodeSelector={"pool": "a"}')
    template = one(docs, "DaemonSet")["spec"]["template"]
    assert template["spec"]["nodeSelector"] == {"pool": "a"}
    settings = yaml.safe_load(one(docs, "ConfigMap", "opsd-config")["data"]["opsd.yaml"])
    assert settings["controller"]["kubernetes"]["node_selector"] == "gen in (h100,h200),pool=a"
    selector = NodeSelector.parse(settings["controller"]["kubernetes"]["node_selector"])
    for labels, admitted in (({"gen": "h200", "pool": "a"}, True), ({"gen": "h200"}, False), ({"pool": "a"}, False)):
        assert fits(labelled(labels), template) is admitted, labels
        assert selector.matches(labels) is admitted, labels
    every = helm.render("--set-json", "gpuNodeTerms=[]")
    assert "affinity" not in one(every, "DaemonSet")["spec"]["template"]["spec"]
    every_settings = yaml.safe_load(one(every, "ConfigMap", "opsd-config")["data"]["opsd.yaml"])
    assert every_settings["controller"]["kubernetes"]["node_selector"] == ""
    proc = helm.template("--set", "controller.config.kubernetes.node_selector=pool=b")
    assert proc.returncode != 0
    assert "the GPU nodes are gpuNodeTerms" in proc.stderr
    proc = helm.template("--set-json", 'gpuNodeTerms=[{"matchExpressions": [{"key": "gen", "operator": "Gt"}]}]')
    assert proc.returncode != 0  # not a label selector's operator: the schema refuses it


def test_the_agents_keep_an_affinity_of_their_own_beside_the_gpu_nodes(helm: Helm) -> None:
    anti: dict[str, Any] = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": []}}
    docs = helm.render("--set-json", f"agent.affinity={json.dumps(anti)}")
    affinity = one(docs, "DaemonSet")["spec"]["template"]["spec"]["affinity"]
    assert affinity["podAntiAffinity"] == anti["podAntiAffinity"]
    assert len(affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]) == 6


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


def test_the_quota_that_admits_the_agents_priority_class_outside_kube_system(
    renders: dict[Combo, list[Obj]], helm: Helm
) -> None:
    """GKE admits system-node-critical pods outside kube-system only under a ResourceQuota whose scope names the
    class: rendered when asked, for the agents' class; not by default."""
    docs = renders[Combo("kube-prometheus-stack-values.yaml", "1.37.0", True)]
    quota = one(docs, "ResourceQuota")
    assert quota["metadata"]["namespace"] == one(docs, "DaemonSet")["metadata"]["namespace"]
    assert quota["spec"]["scopeSelector"]["matchExpressions"] == [
        {"scopeName": "PriorityClass", "operator": "In", "values": ["system-node-critical"]}
    ]
    assert int(quota["spec"]["hard"]["pods"]) >= 1000
    assert not objects(helm.render(), "ResourceQuota")
    other = helm.render("--set", "agent.priorityClassQuota.create=true", "--set", "agent.priorityClassName=gpu-agents")
    assert one(other, "ResourceQuota")["spec"]["scopeSelector"]["matchExpressions"][0]["values"] == ["gpu-agents"]


@pytest.mark.parametrize(
    ("args", "user"),
    [
        pytest.param([], 10001, id="hostPort: the image's user"),
        pytest.param(["--set", "agent.transport=hostNetwork"], 10001, id="hostNetwork: the image's user"),
        pytest.param(["--set", "agent.transport=hostPath"], 0, id="hostPath: root, for its root-owned host directory"),
        pytest.param(["--set", "agent.securityContext.runAsUser=0"], 0, id="root when asked"),
    ],
)
def test_the_agent_runs_as_root_only_where_it_must(helm: Helm, args: list[str], user: int) -> None:
    security = container(one(helm.render(*args), "DaemonSet"))["securityContext"]
    assert security["runAsUser"] == user
    assert security.get("runAsNonRoot", False) is (user != 0)
