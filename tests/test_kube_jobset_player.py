"""The emulated JobSet controller (tests/kube/jobset.py) plays JobSet's failure policy as JobSet does: the rules in
order, on the reason each child Job failed with, ``RestartJob`` recreating the failed Job alone (its
``jobRestarts`` and its pods' ``job-restart-attempt`` up by one, the other Jobs' pods untouched), a whole restart
leaving the Jobs' counts as they were, and ``RestartJob`` refused without its feature gate. Passes are stepped by
hand: the order of events is the test's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes.client
import pytest
import yaml  # type: ignore[import-untyped]

from opsd.backends.kubernetes.cluster import JOB_INDEX_LABEL, JOB_RESTART_ATTEMPT_LABEL, RESTART_ATTEMPT_LABEL
from tests.kube.emulator import KubeEmulator
from tests.kube.jobset import JobSetPlayer, put_secrets_named
from tests.kube.machines import JOBSETS, node
from tests.test_kubernetes_takeover import ScriptedKubelet

ROOT = Path(__file__).resolve().parents[1]
Json = dict[str, Any]
NAMESPACE, NAME = "training", "llama-ft"


def ft_jobset(rules: list[Json] | None = None, *, fail_on_disruption: bool = True) -> Json:
    """docs/examples/jobset-ft.yaml, 2 groups of 2 pods (its failure policy's ``rules`` replaced when given)."""
    jobset: Json = yaml.safe_load((ROOT / "docs" / "examples" / "jobset-ft.yaml").read_text())
    if rules is not None:
        jobset["spec"]["failurePolicy"]["rules"] = rules
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    if not fail_on_disruption:
        del job["podFailurePolicy"]
    for c in job["template"]["spec"]["containers"]:
        c["resources"] = {k: {q: str(v) for q, v in amounts.items()} for k, amounts in c["resources"].items()}
    return jobset


def pods(kube: KubeEmulator) -> dict[str, Json]:
    return {p["metadata"]["name"]: p for p in kube.objects("pods", NAMESPACE)}


def running(kube: KubeEmulator) -> dict[str, Json]:
    return {n: p for n, p in pods(kube).items() if (p.get("status") or {}).get("phase") == "Running"}


def settle(player: JobSetPlayer, done: Callable[[], bool], passes: int = 30) -> None:
    for _ in range(passes):
        if done():
            return
        player.step()
    assert done(), "the player did not get there"


def status(kube: KubeEmulator) -> Json:
    found = kube.get(JOBSETS, NAMESPACE, NAME)
    assert found is not None
    return dict(found.get("status") or {})


def job_restarts(kube: KubeEmulator) -> list[int]:
    (rj,) = status(kube).get("replicatedJobsStatus") or [{"jobRestarts": [0, 0]}]
    return list(rj["jobRestarts"])


def evict(kube: KubeEmulator, name: str) -> None:
    body = kubernetes.client.V1Eviction(metadata=kubernetes.client.V1ObjectMeta(name=name, namespace=NAMESPACE))
    kubernetes.client.CoreV1Api(kube.api_client).create_namespaced_pod_eviction(name, NAMESPACE, body)


def labels(pod: Json) -> dict[str, str]:
    return dict(pod["metadata"].get("labels") or {})


def of_group(found: dict[str, Json], group: int) -> dict[str, Json]:
    return {n: p for n, p in found.items() if labels(p)[JOB_INDEX_LABEL] == str(group)}


def started(
    kube: KubeEmulator, rules: list[Json] | None = None, **options: Any
) -> tuple[JobSetPlayer, ScriptedKubelet]:
    kube.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    for i in range(5):
        kube.put(node(f"node-{i}"))
    gate = options.pop("restart_job_gate", True)
    played = ft_jobset(rules, **options)
    put_secrets_named(kube, played)  # checkpoint-s3, as the docs have it made
    kube.put(played)
    kubelet = ScriptedKubelet()
    player = JobSetPlayer(kube, kubelet, restart_job_gate=gate)
    settle(player, lambda: len(running(kube)) == 4)
    return player, kubelet


def test_an_evicted_pod_recreates_its_job_alone_and_the_other_jobs_pods_are_untouched(kube: KubeEmulator) -> None:
    player, _ = started(kube)
    before = running(kube)
    assert {labels(p)[JOB_RESTART_ATTEMPT_LABEL] for p in before.values()} == {"0"}
    group0 = {n: p["metadata"]["uid"] for n, p in of_group(before, 0).items()}
    evicted = sorted(of_group(before, 1))[0]

    evict(kube, evicted)
    settle(player, lambda: len(of_group(running(kube), 1)) == 2 and not (set(of_group(before, 1)) & set(pods(kube))))

    assert job_restarts(kube) == [0, 1]
    assert status(kube).get("restarts", 0) == 0
    assert (player.restarts, player.job_restarts) == (0, 1)
    now = running(kube)
    assert {n: p["metadata"]["uid"] for n, p in of_group(now, 0).items()} == group0  # never recreated
    for pod in of_group(now, 1).values():
        assert (labels(pod)[JOB_RESTART_ATTEMPT_LABEL], labels(pod)[RESTART_ATTEMPT_LABEL]) == ("1", "0")
    touched = {r.path.split("/")[6] for r in kube.requests if r.method in ("DELETE", "POST") and "/pods/" in r.path}
    assert touched == set(of_group(before, 1))  # the evicted pod, and its Job's other pod deleted with the Job
    assert not touched & set(group0)


@pytest.mark.parametrize(
    ("fail_on_disruption", "whole"),
    [(True, False), (False, True)],
    ids=["an eviction fails the Job through its podFailurePolicy", "without it, by its backoff limit"],
)
def test_the_rules_match_the_reason_the_job_failed_with(
    kube: KubeEmulator, fail_on_disruption: bool, whole: bool
) -> None:
    """Only PodFailurePolicy restarts a Job alone here; any other reason restarts the whole JobSet (no rule: JobSet's
    default)."""
    rules = [{"name": "Evicted", "action": "RestartJob", "onJobFailureReasons": ["PodFailurePolicy"]}]
    player, _ = started(kube, rules, fail_on_disruption=fail_on_disruption)
    evict(kube, sorted(of_group(running(kube), 0))[0])
    settle(player, lambda: player.restarts + player.job_restarts == 1)
    assert (player.restarts, player.job_restarts) == (int(whole), int(not whole))
    assert (status(kube).get("restarts", 0), job_restarts(kube)) == ((1, [0, 0]) if whole else (0, [1, 0]))


def test_a_whole_restart_keeps_the_jobs_own_restart_counts(kube: KubeEmulator) -> None:
    """A crash (BackoffLimitExceeded) under a rule that restarts the JobSet whole, after group 1 was recreated alone:
    every pod is new, at restart attempt 1, and group 1's keep job-restart-attempt 1 (JobSet does not reset it)."""
    rules = [
        {"name": "Evicted", "action": "RestartJobAndIgnoreMaxRestarts", "onJobFailureReasons": ["PodFailurePolicy"]},
        {"name": "Crashed", "action": "RestartJobSet", "onJobFailureReasons": ["BackoffLimitExceeded"]},
    ]
    player, kubelet = started(kube, rules)
    evict(kube, sorted(of_group(running(kube), 1))[0])
    settle(player, lambda: player.job_restarts == 1 and len(running(kube)) == 4)
    first = set(running(kube))

    kubelet.exits[sorted(of_group(running(kube), 0))[0]] = 1
    settle(player, lambda: player.restarts == 1 and len(running(kube)) == 4 and not first & set(running(kube)))

    assert (status(kube)["restarts"], job_restarts(kube)) == (1, [0, 1])
    now = running(kube)
    assert {labels(p)[RESTART_ATTEMPT_LABEL] for p in now.values()} == {"1"}
    assert {g: {labels(p)[JOB_RESTART_ATTEMPT_LABEL] for p in of_group(now, g).values()} for g in (0, 1)} == {
        0: {"0"},
        1: {"1"},
    }


def test_without_the_feature_gate_restart_job_is_refused_and_nothing_is_recreated(kube: KubeEmulator) -> None:
    player, _ = started(kube, restart_job_gate=False)
    before = running(kube)
    assert not any(JOB_RESTART_ATTEMPT_LABEL in labels(p) for p in before.values())  # JobSet labels none
    evicted = sorted(of_group(before, 1))[0]
    evict(kube, evicted)
    for _ in range(10):
        player.step()
    assert player.refused == [f"{NAME}-group-1"]
    assert (player.restarts, player.job_restarts) == (0, 0)
    assert set(pods(kube)) == set(before) - {evicted}  # the failed Job stays failed
    assert "replicatedJobsStatus" not in status(kube)
