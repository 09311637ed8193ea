"""What the chart renders to watch a run and check an install (tests/test_helm.py renders it): the dashboards and
rules as the repository's files, the monitors' values for kube-prometheus-stack, the dashboards' label, the
`helm test` pod and its check run against a real controller and agents, and the release notes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml  # type: ignore[import-untyped]

from opsd.backends.kubernetes.install_check import main as install_check
from opsd.backends.local.processes import free_port
from opsd.controller.controller import Controller
from opsd.controller.state import StateStore
from opsd_agent.daemon import Agent, AgentConfig
from tests.helm_chart import DASHBOARDS, NAMESPACE, RULES, Combo, Helm, Obj, objects, one
from tests.kube.emulator import KubeEmulator
from tests.kube.training import kubeconfig
from tests.serving import start_api
from tests.test_kubernetes_install_check import agent_pod, daemonset


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
    assert c["command"] == [
        "python",
        "-m",
        "opsd.backends.kubernetes.install_check",
        "--namespace",
        NAMESPACE,
        "--controller",
        "http://opsd-controller:8470",
        "--daemonset",
        "opsd-agent",
        "--agent-port",
        "9464",
    ]
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["serviceAccountName"] == "opsd-test"
    role = one(default, "Role", "opsd-test")
    assert role["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert role["rules"] == [  # the DaemonSet by name, the pods: nothing else
        {"apiGroups": ["apps"], "resources": ["daemonsets"], "resourceNames": ["opsd-agent"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
    ]
    assert one(default, "RoleBinding", "opsd-test")["subjects"][0]["name"] == "opsd-test"


def test_helm_test_pods_check_reads_the_controller_and_every_agents_gpus(
    default: list[Obj], tmp_path: Path, kube: KubeEmulator, capsys: pytest.CaptureFixture[str]
) -> None:
    """The check the test pod runs, run here against a real controller API and real agents on loopback (their
    DaemonSet and pod on the emulated API server): an agent that reads its GPUs passes; one without NVML (this
    machine has none) fails the test, naming its node and why."""
    (c,) = one(default, "Pod", "opsd-test")["spec"]["containers"]
    assert c["command"][2] == "opsd.backends.kubernetes.install_check"
    port = free_port()
    server = start_api(Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}")), "t", "127.0.0.1", port)
    seeing = Agent(AgentConfig(socket=str(tmp_path / "a.sock"), metrics_port=0, node="n1", gpu_source="none"))
    blind = Agent(AgentConfig(socket=str(tmp_path / "b.sock"), metrics_port=0, node="n2", gpu_source="nvml"))
    seeing.start()
    blind.start()
    kube.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "opsd"}})
    kube.put(daemonset(1, 1))
    kube.put(agent_pod("n1"))
    config = ["--kubeconfig", str(kubeconfig(kube, tmp_path / "kubeconfig"))]
    args = ["--namespace", "opsd", "--controller", f"http://127.0.0.1:{port}", "--daemonset", "opsd-agent", *config]
    try:
        assert install_check([*args, "--agent-port", str(seeing.metrics_port)]) == 0
        assert capsys.readouterr().out.splitlines() == [
            "controller /healthz: OK",
            "controller API without a token: refused",
            "1 of 1 agent(s) Ready",
            "agent on n1: 0 GPU(s) through none",
            "1 agent(s): OK",
        ]
        assert blind.gpu_access is not None
        if blind.gpu_access.status.available:
            pytest.skip("NVML loads on this machine: no agent here is without GPUs")
        assert install_check([*args, "--agent-port", str(blind.metrics_port)]) == 1
        captured = capsys.readouterr()
        assert "agent on n1: no GPU through nvml: library_not_found" in captured.out
        assert "1 of 1 agents cannot read their GPUs (n1): set agent.gpuAccess" in captured.err
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
