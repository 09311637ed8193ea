"""What the Kubernetes backend reads of a JobSet and its pods: restart attempts, child Jobs, and whether the JobSet is
laid out for a fault-tolerant run.

Two ways a JobSet restarts its pods, and so two launch numberings (a rank's launch is ``OPSD_LAUNCH``, from a pod
label by the downward API):

- whole: every child Job is recreated, ``status.restarts`` goes up by one, and the pods carry it in the label
  ``jobset.sigs.k8s.io/restart-attempt`` (``attempt_of``);
- one child Job alone (the failure policy actions ``RestartJob`` and ``RestartJobAndIgnoreMaxRestarts``, JobSet
  v0.12+ with its feature gate ``RestartJob``): ``status.replicatedJobsStatus[].jobRestarts[index]`` goes up by one,
  and that Job's pods carry it in ``jobset.sigs.k8s.io/job-restart-attempt`` (``job_attempt_of``); a whole restart
  leaves those counts as they were (pkg/controllers/failure_policy.go, jobset_controller.go).

A fault-tolerant run (``fault_tolerance``) is one replicated job whose child Job ``g`` is replica group ``g``, and
whose failure policy recreates a Job alone when its pod is evicted: then every relaunch of a group, by opsd or by
JobSet, raises that group's ``jobRestarts``, and its new pods' ``job-restart-attempt`` is the group's launch.
"""

from __future__ import annotations

from typing import Any

from opsd.backends.kubernetes.cluster import (
    JOB_INDEX_LABEL,
    JOB_RESTART_ATTEMPT_LABEL,
    MIN_REPLICAS_ANNOTATION,
    REPLICA_GROUPS_ANNOTATION,
    RESTART_ATTEMPT_LABEL,
)

Json = dict[str, Any]

#: the failure policy actions that recreate the failed child Job alone
RESTART_JOB_ACTIONS = frozenset({"RestartJob", "RestartJobAndIgnoreMaxRestarts"})
#: the reason a Job fails with when its podFailurePolicy fails it (an evicted pod's DisruptionTarget)
EVICTED_REASON = "PodFailurePolicy"


def _labels(pod: Json) -> dict[str, str]:
    return dict(((pod.get("metadata") or {}).get("labels")) or {})


def _int_label(pod: Json, label: str) -> int | None:
    """The pod's label ``label`` as a whole number; None where it is missing or not one."""
    try:
        return int(_labels(pod)[label])
    except (KeyError, ValueError):
        return None


def attempt_of(pod: Json) -> int:
    return _int_label(pod, RESTART_ATTEMPT_LABEL) or 0


def terminating(pod: Json) -> bool:
    return bool((pod.get("metadata") or {}).get("deletionTimestamp"))


def finished(pod: Json) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def succeeded(pod: Json) -> bool:
    return (pod.get("status") or {}).get("phase") == "Succeeded"


def job_index_of(pod: Json) -> int | None:
    """A pod's child Job's index in its replicated job: a fault-tolerant run's replica group."""
    return _int_label(pod, JOB_INDEX_LABEL)


def job_attempt_of(pod: Json) -> int:
    """How many times JobSet recreated the pod's child Job alone, when the pod was made."""
    return _int_label(pod, JOB_RESTART_ATTEMPT_LABEL) or 0


def labels_job_restarts(pod: Json) -> bool:
    """Whether the pod carries ``job-restart-attempt``: JobSet labels it only with its feature gate RestartJob on."""
    return JOB_RESTART_ATTEMPT_LABEL in _labels(pod)


def _first_replicated_job(jobset: Json) -> Json:
    jobs = (jobset.get("spec") or {}).get("replicatedJobs") or []
    return jobs[0] if jobs else {}


def job_restarts(jobset: Json, index: int) -> int:
    """How many times JobSet recreated child Job ``index`` of the first replicated job alone (its ``jobRestarts``,
    found by name: JobSet lists the replicated jobs' statuses in no set order)."""
    name = _first_replicated_job(jobset).get("name")
    for status in (jobset.get("status") or {}).get("replicatedJobsStatus") or []:
        if status.get("name") == name:
            restarts = status.get("jobRestarts") or []
            return int(restarts[index]) if 0 <= index < len(restarts) else 0
    return 0


def group_pods(jobset: Json) -> int:
    """The pods of one child Job (a replica group): its parallelism."""
    job_spec = (_first_replicated_job(jobset).get("template") or {}).get("spec") or {}
    return int(job_spec.get("parallelism", 1))


def groups_of(jobset: Json) -> int:
    """The child Jobs of the first replicated job (a fault-tolerant run's replica groups)."""
    return int(_first_replicated_job(jobset).get("replicas", 1))


def expected_pods(jobset: Json) -> int:
    """The pods a JobSet runs at once: each replicated Job's replicas times its parallelism."""
    total = 0
    for rj in (jobset.get("spec") or {}).get("replicatedJobs") or []:
        job_spec = ((rj.get("template") or {}).get("spec")) or {}
        total += int(rj.get("replicas", 1)) * int(job_spec.get("parallelism", 1))
    return total


def restarts_jobs_alone(jobset: Json) -> bool:
    """Whether an eviction of a pod of the first replicated job recreates its child Job alone: the first failure
    policy rule that applies to a Job of it failed with ``PodFailurePolicy`` (rules are matched in order, as JobSet
    does) is ``RestartJob`` or ``RestartJobAndIgnoreMaxRestarts``. Else (another action, no rule: JobSet's default
    ``RestartJobSet``) the JobSet restarts whole."""
    name = _first_replicated_job(jobset).get("name")
    for rule in ((jobset.get("spec") or {}).get("failurePolicy") or {}).get("rules") or []:
        reasons, targets = rule.get("onJobFailureReasons") or [], rule.get("targetReplicatedJobs") or []
        if (not reasons or EVICTED_REASON in reasons) and (not targets or name in targets):
            return rule.get("action") in RESTART_JOB_ACTIONS
    return False


def fault_tolerance(jobset: Json) -> tuple[int, int, str]:
    """The replica groups and the quorum's minimum a JobSet's annotations give its run (``opsd.io/replica-groups``,
    ``opsd.io/min-replicas``, default 1), and what keeps them from holding ("" when nothing): a run that is not
    laid out for them is not fault tolerant (1 group), and every recovery restarts it whole."""
    annotations = (jobset.get("metadata") or {}).get("annotations") or {}
    raw_groups = annotations.get(REPLICA_GROUPS_ANNOTATION)
    if raw_groups is None:
        return 1, 1, ""
    raw_min = annotations.get(MIN_REPLICAS_ANNOTATION, "1")
    try:
        groups, min_replicas = int(raw_groups), int(raw_min)
    except ValueError:
        return 1, 1, f"{REPLICA_GROUPS_ANNOTATION}={raw_groups!r}, {MIN_REPLICAS_ANNOTATION}={raw_min!r}: not numbers"
    if groups < 1 or not 1 <= min_replicas <= groups:
        return (
            1,
            1,
            f"{MIN_REPLICAS_ANNOTATION}={min_replicas} must be between 1 and {REPLICA_GROUPS_ANNOTATION}={groups}",
        )
    if groups == 1:
        return 1, 1, ""
    jobs = (jobset.get("spec") or {}).get("replicatedJobs") or []
    if len(jobs) != 1 or groups_of(jobset) != groups:
        found = f"{len(jobs)} replicated jobs" if len(jobs) != 1 else f"replicas {groups_of(jobset)}"
        return (
            1,
            1,
            f"{groups} replica groups need one replicated job with replicas {groups} (a Job per group): {found}",
        )
    if not restarts_jobs_alone(jobset):
        why = (
            "its failurePolicy restarts the whole JobSet when a pod is evicted: a replica group cannot be relaunched"
            " alone without a rule RestartJobAndIgnoreMaxRestarts on PodFailurePolicy (docs/examples/jobset-ft.yaml)"
        )
        return 1, 1, why
    return groups, min_replicas, ""
