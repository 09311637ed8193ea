"""The fault-tolerant JobSet of docs/examples/jobset-ft.yaml, checked as the docs' other JobSet is (JobSet's and
Kubernetes' schemas, Pod Security "restricted", yamllint) and for what a fault-tolerant run needs of it: every
reason one of its Jobs can fail with recreates that Job alone, each group is a world of its own wired to the
chart's Lighthouse, and the ranks' launch is their Job's restart count. Also how opsd reads a JobSet's layout
(``opsd.backends.kubernetes.jobsets.fault_tolerance``), by named cases."""

from __future__ import annotations

import copy
import re
import time
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml  # type: ignore[import-untyped]
from yamllint import linter as yamllint_linter  # type: ignore[import-untyped]
from yamllint.config import YamlLintConfig  # type: ignore[import-untyped]

from opsd.backends.kubernetes.api import KubeApi
from opsd.backends.kubernetes.backend import KubernetesBackend
from opsd.backends.kubernetes.cluster import JOB_INDEX_LABEL, JOB_RESTART_ATTEMPT_LABEL
from opsd.backends.kubernetes.config import KubernetesConfig
from opsd.backends.kubernetes.jobsets import RESTART_JOB_ACTIONS, fault_tolerance, restarts_jobs_alone
from opsd.controller.state import StateStore
from opsd.protocol.ft import ADVERTISE_HOST_ENV, ReplicaGroupEnv, group_layout
from opsd.protocol.mesh import MeshSpec
from tests.helm_chart import CHART, KUBE_VERSIONS, crd_errors, env
from tests.kube.emulator import KubeEmulator
from tests.kube.machines import Cluster
from tests.pod_security import violations

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "jobset-ft.yaml"
Json = dict[str, Any]


def example() -> Json:
    jobset: Json = yaml.safe_load(EXAMPLE.read_text())
    return jobset


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_the_example_is_valid(kube: str) -> None:
    jobset = example()
    assert crd_errors(jobset) == []
    (replicated,) = jobset["spec"]["replicatedJobs"]
    template = replicated["template"]
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "group"}, "spec": template["spec"]}
    kubernetes_validate.validate(job, kube, strict=True)
    for rule in jobset["spec"]["failurePolicy"]["rules"]:
        # the JobSet webhook's rule for names (api/jobset/v1alpha2/jobset_types.go)
        assert re.fullmatch(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?", rule["name"])
    assert violations(template["spec"]["template"]["spec"], "restricted") == []
    config = YamlLintConfig(file=str(CHART / ".yamllint"))
    assert [p.message for p in yamllint_linter.run(EXAMPLE.read_text(), config, str(EXAMPLE))] == []


def first_action(jobset: Json, reason: str) -> str | None:
    """The action of the first failurePolicy rule that applies to a Job of the example failed with ``reason``."""
    name = jobset["spec"]["replicatedJobs"][0]["name"]
    for rule in jobset["spec"]["failurePolicy"]["rules"]:
        reasons, targets = rule.get("onJobFailureReasons") or [], rule.get("targetReplicatedJobs") or []
        if (not reasons or reason in reasons) and (not targets or name in targets):
            return str(rule["action"])
    return None  # JobSet's default: RestartJobSet


def test_every_failure_of_a_group_recreates_its_job_alone() -> None:
    jobset = example()
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    # a Job of this template fails for one of two reasons: a pod failed (backoffLimit 0), or its podFailurePolicy
    # failed it on an eviction; the others need fields it has not (a deadline, a per-index backoff)
    assert job["backoffLimit"] == 0
    assert not {"activeDeadlineSeconds", "backoffLimitPerIndex", "maxFailedIndexes"} & set(job)
    assert job["podFailurePolicy"]["rules"] == [
        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    ]
    assert first_action(jobset, "PodFailurePolicy") == "RestartJobAndIgnoreMaxRestarts"  # not the group's fault
    assert first_action(jobset, "BackoffLimitExceeded") == "RestartJob"  # counted against maxRestarts
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] >= 1
    assert restarts_jobs_alone(jobset)
    for reason in ("PodFailurePolicy", "BackoffLimitExceeded"):
        assert first_action(jobset, reason) in RESTART_JOB_ACTIONS  # the JobSet never restarts whole


def test_each_group_is_a_world_of_its_own_in_one_quorum() -> None:
    jobset = example()
    name = jobset["metadata"]["name"]
    annotations = jobset["metadata"]["annotations"]
    (replicated,) = jobset["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    (c,) = job["template"]["spec"]["containers"]
    variables = env(c)

    assert fault_tolerance(jobset) == (replicated["replicas"], int(annotations["opsd.io/min-replicas"]), "")
    assert annotations["opsd.io/run"] == job["template"]["metadata"]["annotations"]["opsd.io/run"]
    assert (job["parallelism"], job["completions"], job["completionMode"]) == (2, 2, "Indexed")

    def field(variable: str) -> str:
        return str(variables[variable]["valueFrom"]["fieldRef"]["fieldPath"])

    assert field("REPLICA_GROUP_ID") == f"metadata.labels['{JOB_INDEX_LABEL}']"
    assert field("NUM_REPLICA_GROUPS") == "metadata.labels['jobset.sigs.k8s.io/replicatedjob-replicas']"
    assert field("OPSD_LAUNCH") == f"metadata.labels['{JOB_RESTART_ATTEMPT_LABEL}']"
    assert field("NODE_RANK") == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert field(ADVERTISE_HOST_ENV) == "status.podIP"  # a pod's bare host name resolves in no other pod
    assert variables["OPSD_FT_MIN_REPLICAS"]["value"] == annotations["opsd.io/min-replicas"]
    # the chart's Lighthouse, released as the docs install it: release opsd in namespace opsd, its default port
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    lighthouse = f"http://opsd-lighthouse.opsd.svc:{values['lighthouse']['port']}"
    assert variables["TORCHFT_LIGHTHOUSE"]["value"] == lighthouse

    # torchrun per group: its own Job's pod of completion index 0 (the JobSet's headless Service), its nodes
    command = c["command"]
    assert command[0] == "torchrun"
    options = dict(a.removeprefix("--").split("=", 1) for a in command[1:] if a.startswith("--") and "=" in a)
    assert options["master-addr"] == f"{name}-{replicated['name']}-$(REPLICA_GROUP_ID)-0.{name}"
    assert options["node-rank"] == "$(NODE_RANK)"
    assert int(options["nnodes"]) == job["parallelism"]
    assert jobset["spec"]["network"]["enableDNSHostnames"] is True
    train = command[command.index("examples.train") + 1 :]
    assert "--ft" in train
    mesh = MeshSpec.parse(train[train.index("--mesh") + 1])
    groups = ReplicaGroupEnv(group=1, groups=replicated["replicas"], lighthouse=lighthouse)
    world = group_layout(mesh, groups).world_size  # each group: the mesh without dp_replicate
    assert world == int(options["nnodes"]) * int(options["nproc-per-node"])
    assert c["resources"]["limits"]["nvidia.com/gpu"] == int(options["nproc-per-node"])


def with_rules(rules: list[Json], **changes: Any) -> Json:
    jobset = copy.deepcopy(example())
    jobset["spec"]["failurePolicy"]["rules"] = rules
    for key, value in changes.items():
        if key == "annotations":
            jobset["metadata"]["annotations"] = value
        elif key == "replicas":
            jobset["spec"]["replicatedJobs"][0]["replicas"] = value
        elif key == "second_job":
            jobset["spec"]["replicatedJobs"].append({**jobset["spec"]["replicatedJobs"][0], "name": "driver"})
    return jobset


ALONE = {"name": "Evicted", "action": "RestartJobAndIgnoreMaxRestarts", "onJobFailureReasons": ["PodFailurePolicy"]}
WHOLE = {"name": "Evicted", "action": "RestartJobSetAndIgnoreMaxRestarts", "onJobFailureReasons": ["PodFailurePolicy"]}
ANY_WHOLE = {"name": "Anything", "action": "RestartJobSet"}
ELSEWHERE = {**ALONE, "name": "Other", "targetReplicatedJobs": ["driver"]}
FT = {"opsd.io/run": "r", "opsd.io/replica-groups": "2", "opsd.io/min-replicas": "1"}


@pytest.mark.parametrize(
    ("jobset", "expected"),
    [
        (with_rules([ALONE], annotations={"opsd.io/run": "r"}), (1, 1, "")),
        (with_rules([ALONE], annotations=FT), (2, 1, "")),
        (with_rules([ALONE], annotations={**FT, "opsd.io/min-replicas": "2"}), (2, 2, "")),
        (with_rules([WHOLE], annotations={**FT, "opsd.io/replica-groups": "1"}), (1, 1, "")),
        (with_rules([ALONE], annotations={**FT, "opsd.io/min-replicas": "3"}), (1, 1, "must be between 1 and")),
        (with_rules([ALONE], annotations={**FT, "opsd.io/replica-groups": "two"}), (1, 1, "not numbers")),
        (with_rules([ALONE], annotations=FT, replicas=3), (1, 1, "replicas 3")),
        (with_rules([ALONE], annotations=FT, second_job=True), (1, 1, "2 replicated jobs")),
        (with_rules([WHOLE], annotations=FT), (1, 1, "restarts the whole JobSet")),
        (with_rules([ANY_WHOLE, ALONE], annotations=FT), (1, 1, "restarts the whole JobSet")),
        (with_rules([ELSEWHERE, ALONE], annotations=FT), (2, 1, "")),
        (with_rules([], annotations=FT), (1, 1, "restarts the whole JobSet")),
    ],
    ids=[
        "no replica groups annotated",
        "two groups, a Job each, recreated alone",
        "a quorum of both",
        "one group is no fault tolerance",
        "a minimum above the groups",
        "not a number",
        "replicas other than the groups",
        "a second replicated job",
        "an eviction restarts the JobSet whole",
        "the first rule that applies decides",
        "a rule for another replicated job does not apply",
        "no rule: JobSet's default restarts it whole",
    ],
)
def test_how_opsd_reads_a_jobsets_replica_groups(jobset: Json, expected: tuple[int, int, str]) -> None:
    groups, min_replicas, problem = fault_tolerance(jobset)
    assert (groups, min_replicas) == expected[:2]
    assert (expected[2] in problem) if expected[2] else problem == ""


def test_a_jobset_not_laid_out_for_its_replica_groups_is_told_and_recovered_whole(
    kube: KubeEmulator, store: StateStore
) -> None:
    """Annotated with replica groups, but an eviction restarts it whole (the docs' plain JobSet's failure policy):
    the run is not fault tolerant (every recovery restarts it whole), and a Warning Event on the JobSet says why,
    once."""
    jobset = with_rules([WHOLE], annotations=FT)
    jobset["metadata"]["uid"] = "uid-1"
    kube.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": jobset["metadata"]["namespace"]}})
    kube.put(jobset)
    backend = KubernetesBackend(KubeApi(kube.api_client), KubernetesConfig(namespace="opsd"))
    cluster = Cluster(backend, store)
    try:
        for _ in range(2):
            cluster.reconciler.sync(time.time())
    finally:
        cluster.close()
    run = store.run("r")
    assert run is not None
    assert (run.spec.replica_groups, run.spec.replicas.fault_tolerant) == (1, False)
    (event,) = [
        e for e in kube.objects("events", jobset["metadata"]["namespace"]) if e["reason"] == "OpsdNotFaultTolerant"
    ]
    assert event["type"] == "Warning"
    assert "restarts the whole JobSet when a pod is evicted" in event["message"]
