"""The chart's Lighthouse (``lighthouse.enabled``), rendered by the real helm: off by default; on, a Deployment of one
pod (replaced by stopping the old one first), a Service and a NetworkPolicy that pass ``helm lint --strict`` and
kubernetes-validate, a pod that fits Pod Security "restricted" and is probed on its TCP port, the refusals of
values that cannot work, and the rendered command line run for real: its options are opsd's own
(``LighthouseConfig.argv``), and torchft's Lighthouse listens with them."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from opsd.backends.local import lighthouse
from opsd.backends.local.processes import free_port, kill_group, wait_listening
from opsd.protocol.ft import LighthouseConfig
from tests.helm_chart import KUBE_VERSIONS, RELEASE, Helm, Obj, container, one
from tests.pod_security import api_refusals, violations

IMAGE = (
    "--set",
    "lighthouse.image.repository=registry.example.com/ml/trainer",
    "--set",
    "lighthouse.image.tag=2026.11",
)
ON = ("--set", "lighthouse.enabled=true", *IMAGE)


def lighthouse_objects(docs: list[Obj]) -> list[Obj]:
    return [d for d in docs if (d["metadata"].get("labels") or {}).get("app.kubernetes.io/component") == "lighthouse"]


def test_the_lighthouse_is_off_by_default(helm: Helm) -> None:
    assert lighthouse_objects(helm.render()) == []
    assert lighthouse_objects(helm.render("--set", "lighthouse.enabled=false", *IMAGE)) == []


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_lint_and_kubernetes_validate(helm: Helm, kube: str) -> None:
    lint = helm.run("lint", "--strict", "--kube-version", kube, *ON)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    found = lighthouse_objects(helm.render(*ON, kube=kube))
    assert sorted(d["kind"] for d in found) == ["Deployment", "NetworkPolicy", "Service"]
    for d in found:
        kubernetes_validate.validate(json.loads(json.dumps(d)), kube, strict=True)
        labels = d["metadata"]["labels"]  # the chart's standard labels, as on its other objects
        assert (labels["app.kubernetes.io/instance"], labels["app.kubernetes.io/managed-by"]) == (RELEASE, "Helm")
        assert labels["helm.sh/chart"].startswith("opsd-")


def test_one_restricted_pod_probed_on_its_port_behind_a_service(helm: Helm) -> None:
    docs = helm.render(*ON)
    deployment = one(docs, "Deployment", f"{RELEASE}-lighthouse")
    spec = deployment["spec"]
    assert (spec["replicas"], spec["strategy"]) == (1, {"type": "Recreate"})  # never two behind the Service
    pod = spec["template"]["spec"]
    assert violations(pod, "restricted") == []
    assert api_refusals(pod) == []
    assert pod["automountServiceAccountToken"] is False
    c = container(deployment)
    assert c["image"] == "registry.example.com/ml/trainer:2026.11"
    assert c["command"] == ["torchft_lighthouse"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    assert c["resources"] == {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}
    (port,) = c["ports"]
    assert (port["name"], port["containerPort"]) == ("lighthouse", 29510)
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["tcpSocket"] == {"port": "lighthouse"}, probe
    service = one(docs, "Service", f"{RELEASE}-lighthouse")
    assert service["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    assert service["spec"]["ports"] == [
        {"name": "lighthouse", "port": 29510, "targetPort": "lighthouse", "protocol": "TCP"}
    ]
    policy = one(docs, "NetworkPolicy", f"{RELEASE}-lighthouse")["spec"]
    assert policy["podSelector"]["matchLabels"] == service["spec"]["selector"]
    (ingress,) = policy["ingress"]
    assert ingress == {"from": [{"namespaceSelector": {}}], "ports": [{"port": "lighthouse", "protocol": "TCP"}]}
    no_policy = helm.render(*ON, "--set", "networkPolicy.enabled=false")
    assert [d["kind"] for d in lighthouse_objects(no_policy) if d["kind"] == "NetworkPolicy"] == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--set", "lighthouse.enabled=true"), "lighthouse.enabled needs lighthouse.image.repository"),
        (
            (*ON, "--set", "lighthouse.heartbeatTimeoutMs=100"),
            "lighthouse.heartbeatTimeoutMs must be above lighthouse.quorumTickMs",
        ),
        ((*ON, "--set", "lighthouse.minReplicas=0"), "/lighthouse/minReplicas"),
        ((*ON, "--set", "lighthouse.port=70000"), "/lighthouse/port"),
        ((*ON, "--set", "lighthouse.replicas=2"), "replicas"),
    ],
    ids=["no image", "a heartbeat timeout under the tick", "no quorum", "not a port", "an unknown key"],
)
def test_values_that_cannot_work_are_refused(helm: Helm, args: tuple[str, ...], message: str) -> None:
    proc = helm.template(*args)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_the_rendered_command_line_runs_torchfts_lighthouse_with_opsds_options(helm: Helm, tmp_path: Path) -> None:
    port = free_port()
    knobs = {"minReplicas": 2, "quorumTickMs": 50, "joinTimeoutMs": 500, "heartbeatTimeoutMs": 1500}
    values = [f"lighthouse.{k}={v}" for k, v in knobs.items()]
    docs = helm.render(*ON, "--set", f"lighthouse.port={port}", "--set", ",".join(values))
    args = container(one(docs, "Deployment"))["args"]
    config = LighthouseConfig(min_replicas=2, quorum_tick_ms=50, join_timeout_ms=500, heartbeat_timeout_ms=1500)
    assert args == config.argv(port, host="[::]")[1:]
    # torchft's Lighthouse given those options (by opsd's runner, which loads it without torch): it listens there
    log = tmp_path / "lighthouse.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, lighthouse.__file__, *args], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_listening(proc, port, timeout_s=30)
        with socket.create_connection(("127.0.0.1", port), timeout=2):  # the probe: a TCP connect
            pass
        assert proc.poll() is None, log.read_text()
    finally:
        kill_group(proc.pid)
        proc.wait(timeout=10)
