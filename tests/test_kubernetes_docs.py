"""docs/kubernetes.md's walk from an empty GPU cluster to a run that survives an XID, run where it runs without a
cluster: its `helm` commands on the values file it shows (`helm install` as the `helm template` it is made of, with
the same arguments), `kubernetes-validate --strict` as it pipes it, each namespace's Pod Security level as it labels
them against the pods that go there, its spares' label and taint as opsd reads them, and the JobSet it applies:
docs/examples/jobset.yaml, in the doc verbatim, valid against the JobSet CRD and Kubernetes' schemas, wired to opsd,
and its host-directory variant admitted by "privileged" only."""

from __future__ import annotations

import copy
import os
import re
import shlex
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml  # type: ignore[import-untyped]

from opsd.backends.kubernetes.cluster import POOL_LABEL, SPARE_POOL, SPARE_TAINT
from tests.helm_chart import CHART, JOBSET_EXAMPLE, KUBE_VERSIONS, Helm, crd_errors, env, parse
from tests.pod_security import level_of, violations

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
    # any GPU node (its GPU requests select them, on every platform), back onto the run's own after a restart; the
    # GPU pools' taint tolerated, no opsd taint, no node labelled by hand
    assert "nodeSelector" not in spec
    assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
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
