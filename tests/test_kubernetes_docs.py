"""docs/kubernetes.md's walk from an empty GPU cluster to a run that survives an XID, run where it runs without a
cluster: its `helm` commands on the values file it shows (`helm install` as the `helm template` it is made of, with
the same arguments), `kubernetes-validate --strict` as it pipes it, each namespace's Pod Security level as it labels
them against the pods that go there, its spares' label and taint as opsd reads them, and the JobSet it applies."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

from opsd.protocol.cluster import POOL_LABEL, SPARE_POOL, SPARE_TAINT
from tests.pod_security import violations
from tests.test_helm import Helm, parse

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "kubernetes.md"
VENV_BIN = Path(__file__).resolve().parents[1] / ".venv" / "bin"


def walkthrough() -> str:
    text = DOC.read_text()
    start = text.index("## From an empty GPU cluster to a run that survives an XID")
    return text[start : text.index("\n## ", start + 1)]


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", walkthrough(), flags=re.S | re.M)


def commands() -> list[str]:
    """Every command of the walkthrough's shell blocks, continuation lines joined."""
    out = []
    for block in blocks("sh"):
        out += [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    return out


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the commands run: the repository's chart and docs as they name them, and the doc's values file."""
    work = tmp_path_factory.mktemp("walkthrough")
    (work / "helm").symlink_to(ROOT / "helm")
    (work / "docs").symlink_to(ROOT / "docs")
    (values,) = [b for b in blocks("yaml") if b.startswith("# my-values.yaml")]
    (work / "my-values.yaml").write_text(values)
    return work


def run(command: str, helm: Helm, workdir: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{Path(helm.path).parent}{os.pathsep}{VENV_BIN}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(command, shell=True, cwd=workdir, env=env, capture_output=True, text=True, timeout=120)


def test_the_helm_commands_run(helm: Helm, workdir: Path) -> None:
    helm_commands = [c for c in commands() if c.startswith("helm ")]
    assert [c.split()[1] for c in helm_commands] == ["lint", "template", "install", "test"]
    for command in helm_commands:
        if command.startswith("helm test"):
            continue  # needs the installed release
        if command.startswith("helm install"):
            command = command.replace("helm install", "helm template", 1)  # what install renders, offline
        proc = run(command, helm, workdir)
        assert proc.returncode == 0, f"{command}\n{proc.stdout}\n{proc.stderr}"
        assert "ERROR" not in proc.stdout + proc.stderr


def rendered(helm: Helm, workdir: Path) -> list[dict[str, Any]]:
    (install,) = [c for c in commands() if c.startswith("helm install")]
    args = shlex.split(install)[2:]  # opsd helm/opsd -n opsd -f my-values.yaml
    proc = run(shlex.join(["helm", "template", *args, "--api-versions", "monitoring.coreos.com/v1"]), helm, workdir)
    assert proc.returncode == 0, proc.stderr
    return parse(proc.stdout)


def test_each_namespace_admits_the_pods_that_go_there(helm: Helm, workdir: Path) -> None:
    """The levels the walkthrough labels its namespaces with admit opsd's pods and the run's."""
    levels = dict(
        re.findall(r"kubectl label namespace (\S+) pod-security\.kubernetes\.io/enforce=(\w+)", " ".join(commands()))
    )
    assert levels == {"opsd": "privileged", "training": "restricted"}
    docs = rendered(helm, workdir)
    for d in docs:
        if d["kind"] in ("StatefulSet", "DaemonSet", "Job"):
            assert d["metadata"]["namespace"] == "opsd"
            assert violations(d["spec"]["template"]["spec"], levels["opsd"]) == []
    (applied,) = [c.split()[-1] for c in commands() if c.startswith("kubectl apply -f")]
    jobset = yaml.safe_load((workdir / applied).read_text())
    namespace = jobset["metadata"]["namespace"]
    for replicated in jobset["spec"]["replicatedJobs"]:
        assert violations(replicated["template"]["spec"]["template"]["spec"], levels[namespace]) == []
    # the agents are let in from the training namespace, as the values file says
    (agent_policy,) = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "opsd-agent"]
    ranks = agent_policy["spec"]["ingress"][0]["from"]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}} in ranks
    # the GPU access the values chose: GKE's host driver
    (daemonset,) = [d for d in docs if d["kind"] == "DaemonSet"]
    volumes = {v["name"]: v for v in daemonset["spec"]["template"]["spec"]["volumes"]}
    assert volumes["nvidia-driver"]["hostPath"]["path"] == "/home/kubernetes/bin/nvidia"


def test_the_spares_are_designated_as_opsd_reads_them() -> None:
    labelled = [c.split()[-1] for c in commands() if c.startswith("kubectl label node")]
    tainted = [c.split()[-1] for c in commands() if c.startswith("kubectl taint node")]
    assert (labelled, tainted) == ([f"{POOL_LABEL}={SPARE_POOL}"], [f"{SPARE_TAINT}=true:NoSchedule"])
    # the run's nodes are only read: nobody labels them
    assert [c for c in commands() if "opsd.io/run=" in c] == ["kubectl get nodes -l opsd.io/run=llama-70b"]
