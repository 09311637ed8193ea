"""What the emulated API server has no controller for, played by the tests: the JobSet controller, the scheduler
and, given a ``Kubelet``, the kubelet (``JobSetPlayer``).

On every pass (``step``), for each JobSet of the emulator:

- JobSet controller: its restart attempt is ``status.restarts`` (0 at first). Each (replicated job, index) is a child
  Job, played by its pods alone (no Job object): ``parallelism`` pods, named after the JobSet, the replicated job,
  the index, the completion index and the attempts, labelled ``jobset.sigs.k8s.io/jobset-name``,
  ``replicatedjob-name``, ``job-index`` and ``restart-attempt``, their completion index in the annotation and label
  ``batch.kubernetes.io/job-completion-index``, their spec from the template (containers, ``nodeSelector``,
  tolerations). With the ``RestartJob`` feature gate on (``restart_job_gate``, the default), each child Job also
  has its own restart count, ``status.replicatedJobsStatus[].jobRestarts[index]`` (0 at first), which its pods
  carry in the label ``jobset.sigs.k8s.io/job-restart-attempt``; a whole restart leaves those counts as they are.
- A child Job fails when a pod of it is gone (an eviction deleted it), carries the condition ``DisruptionTarget``, or
  failed: a failed pod fails its Job at once (``backoffLimit: 0``). Its failure reason is ``PodFailurePolicy`` when
  the pod was disrupted (``DisruptionTarget``, also read from its last state when it is gone, as the Job
  controller's watch sees it) and the Job's ``podFailurePolicy`` has a ``FailJob`` rule on that condition, else
  ``BackoffLimitExceeded``. The JobSet's ``failurePolicy.rules`` are matched as JobSet does
  (pkg/controllers/failure_policy.go): rule by rule in order, the first rule whose ``onJobFailureReasons`` (none:
  any) holds the reason and whose ``targetReplicatedJobs`` (none: any) holds the Job's replicated job, applied to
  the failed Job that failed first; one action per pass.
- ``RestartJob`` / ``RestartJobAndIgnoreMaxRestarts``: that Job alone is recreated: its ``jobRestarts[index]`` goes
  up by one, its pods left are deleted through the API, gracefully (as the foreground deletion of the Job), and
  once they are all gone its new pods are created with the new ``job-restart-attempt``; the other Jobs' pods are
  not touched. With the gate off, the action is refused (JobSet logs an error and changes nothing; recorded in
  ``refused``) and the failed Job stays failed.
- Any other action, no matching rule, or no ``failurePolicy``: the JobSet restarts whole, as JobSet's
  host-maintenance failure policy makes it (``RestartJobSetAndIgnoreMaxRestarts``): ``status.restarts`` goes up by
  one; the pods of earlier attempts are deleted through the API, gracefully (a pod marked ``stick_terminating``
  stays Terminating until someone deletes it at once), and only once they are all gone (the Jobs' names are free
  again) are the pods of the new attempt created. Once every pod of the current Jobs succeeded, the JobSet gets
  the condition ``Completed``.
- scheduler: a pending pod goes to a node whose labels match its ``nodeSelector``, that is not unschedulable,
  whose ``NoSchedule`` / ``NoExecute`` taints it tolerates, and that runs no other pod of the attempt (one pod per
  node, as JobSet's exclusive placement); of those, the one its ``preferredDuringSchedulingIgnoredDuringExecution``
  node affinity scores highest (the sum of the weights of the terms it matches: ``In``, ``NotIn``, ``Exists``,
  ``DoesNotExist``, as the scheduler's NodeAffinity plugin), the first by name among equals; else it stays
  Pending.
- kubelet: a placed pod is started (``Kubelet.start``, with its rank: job index x parallelism + completion index)
  once the Secrets its variables name are there (``secret_env``)
  and Running; its exit (``Kubelet.exit_code``) makes it Succeeded or Failed; a pod gone from the API server is
  stopped (``Kubelet.stop``).

Not played: Job objects (the pods are the JobSet's directly), backoff (``backoffLimit`` above 0), the other
``podFailurePolicy`` rules (``onExitCodes``, ``Ignore``, ``Count``), ``onJobFailureMessagePatterns``, ``FailJobSet``
and ``maxRestarts`` (every restart is made, none fails the JobSet), a JobSet without ``failurePolicy`` failing at
its first failure (it restarts whole here), gang scheduling, the webhook (a ``RestartJob`` rule with the gate off is
admitted here, and refused when applied).
"""

from __future__ import annotations

import base64
import itertools
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import kubernetes.client
from kubernetes.client import ApiException

from opsd.backends.kubernetes.cluster import (
    JOB_INDEX_LABEL,
    JOB_RESTART_ATTEMPT_LABEL,
    JOBSET_NAME_LABEL,
    RESTART_ATTEMPT_LABEL,
)
from tests.kube.emulator import KubeEmulator

log = logging.getLogger(__name__)

Json = dict[str, Any]
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
RESTART_JOB_ACTIONS = frozenset({"RestartJob", "RestartJobAndIgnoreMaxRestarts"})
POD_FAILURE_POLICY, BACKOFF_LIMIT_EXCEEDED = "PodFailurePolicy", "BackoffLimitExceeded"


class Kubelet(Protocol):
    """Runs a pod's containers on its node (the tests: real rank processes)."""

    def start(self, pod: Json, node: str, index: int, attempt: int) -> None: ...

    def exit_code(self, pod: Json) -> int | None: ...

    def stop(self, pod: Json) -> None: ...


@dataclass(frozen=True)
class ChildJob:
    """A child Job of a JobSet at one of its restarts: its replicated job, its index and its own restart count."""

    replicated_job: str
    index: int
    job_attempt: int


def label_int(obj: Json, key: str, default: int = -1) -> int:
    try:
        return int(((obj.get("metadata") or {}).get("labels") or {}).get(key, str(default)))
    except ValueError:
        return default


def attempt_of(pod: Json) -> int:
    return label_int(pod, RESTART_ATTEMPT_LABEL)


def conditions(obj: Json) -> dict[str, str]:
    return {c.get("type", ""): c.get("status", "") for c in (obj.get("status") or {}).get("conditions") or []}


def job_restarts(jobset: Json) -> dict[str, list[int]]:
    """Each replicated job's ``jobRestarts``, one count per index (zeros while the status has none, as JobSet reads
    them)."""
    statuses = {s.get("name"): s for s in (jobset.get("status") or {}).get("replicatedJobsStatus") or []}
    out = {}
    for rj in (jobset.get("spec") or {}).get("replicatedJobs") or []:
        replicas = int(rj.get("replicas", 1))
        counts = [int(n) for n in (statuses.get(rj["name"]) or {}).get("jobRestarts") or []]
        out[rj["name"]] = (counts + [0] * replicas)[:replicas]
    return out


def fails_job_on_disruption(job_spec: Json) -> bool:
    """Whether a Job's ``podFailurePolicy`` fails it (``FailJob``) on a pod condition ``DisruptionTarget``."""
    for rule in (job_spec.get("podFailurePolicy") or {}).get("rules") or []:
        on = rule.get("onPodConditions") or []
        if rule.get("action") == "FailJob" and any(
            c.get("type") == "DisruptionTarget" and c.get("status", "True") == "True" for c in on
        ):
            return True
    return False


def rule_applies(rule: Json, replicated_job: str, reason: str) -> bool:
    """Whether a ``failurePolicy`` rule applies to a Job of ``replicated_job`` that failed with ``reason``."""
    reasons, targets = rule.get("onJobFailureReasons") or [], rule.get("targetReplicatedJobs") or []
    return (not reasons or reason in reasons) and (not targets or replicated_job in targets)


def tolerated(taint: Json, tolerations: list[Json]) -> bool:
    for t in tolerations:
        if t.get("operator") == "Exists" and not t.get("key"):
            return True
        if t.get("key") == taint.get("key") and (t.get("operator") == "Exists" or t.get("value") == taint.get("value")):
            return not t.get("effect") or t.get("effect") == taint.get("effect")
    return False


def matches(labels: Mapping[str, str], expression: Json) -> bool:
    """A node selector requirement (``matchExpressions`` item) against a node's labels."""
    key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
    if operator == "In":
        return labels.get(key) in values
    if operator == "NotIn":
        return labels.get(key) not in values
    if operator == "Exists":
        return key in labels
    if operator == "DoesNotExist":
        return key not in labels
    raise ValueError(f"node selector operator {operator!r} is not played")


def preference(node: Json, pod: Json) -> int:
    """The pod's preferred node affinity's score of ``node``: the weights of the terms whose expressions all hold."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    affinity = ((pod.get("spec") or {}).get("affinity") or {}).get("nodeAffinity") or {}
    return sum(
        int(term.get("weight", 0))
        for term in affinity.get("preferredDuringSchedulingIgnoredDuringExecution") or []
        if all(matches(labels, e) for e in (term.get("preference") or {}).get("matchExpressions") or [])
    )


def required_affinity_holds(labels: Mapping[str, str], pod: Json) -> bool:
    """The pod's required node affinity: its terms ORed, each term's expressions ANDed (none: every node)."""
    affinity = ((pod.get("spec") or {}).get("affinity") or {}).get("nodeAffinity") or {}
    required = affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    terms = required.get("nodeSelectorTerms") or []
    return not terms or any(all(matches(labels, e) for e in term.get("matchExpressions") or []) for term in terms)


def has_extended_resources(node: Json, pod: Json) -> bool:
    """Whether the node has the extended resources (``nvidia.com/gpu``: a name with a domain) the pod's containers ask
    for, in its ``status.allocatable`` (a node without them has none; one pod per node, as the player places)."""
    asked: dict[str, int] = {}
    for c in (pod.get("spec") or {}).get("containers") or []:
        resources = c.get("resources") or {}
        amounts = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        for name, amount in amounts.items():
            if "/" in name:
                asked[name] = asked.get(name, 0) + int(amount)
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    return all(int(allocatable.get(name, 0)) >= amount for name, amount in asked.items())


def fits(node: Json, pod: Json) -> bool:
    labels = (node.get("metadata") or {}).get("labels") or {}
    spec = pod.get("spec") or {}
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    if not required_affinity_holds(labels, pod) or not has_extended_resources(node, pod):
        return False
    if (node.get("spec") or {}).get("unschedulable"):
        return False
    taints = [t for t in (node.get("spec") or {}).get("taints") or [] if t.get("effect") in ("NoSchedule", "NoExecute")]
    return all(tolerated(t, spec.get("tolerations") or []) for t in taints)


def secret_env(kube: KubeEmulator, namespace: str, pod: Json) -> dict[str, str] | None:
    """The variables of ``pod``'s containers taken from Secrets (``valueFrom.secretKeyRef``), as its kubelet sets
    them; None while a Secret or key that is not ``optional`` is missing."""
    out: dict[str, str] = {}
    for container in (pod.get("spec") or {}).get("containers") or []:
        for variable in container.get("env") or []:
            ref = (variable.get("valueFrom") or {}).get("secretKeyRef")
            if not ref:
                continue
            secret = kube.get("secrets", namespace, ref["name"]) or {}
            value = (secret.get("data") or {}).get(ref["key"])
            if value is None:
                if ref.get("optional"):
                    continue
                return None
            out[variable["name"]] = base64.b64decode(value).decode()
    return out


def put_secrets_named(kube: KubeEmulator, jobset: Json) -> None:
    """Put every Secret the pods of ``jobset`` take variables from (each key a placeholder): those its users make
    (``checkpoint-s3``) and those opsd makes (the run's key), for a test that plays the JobSet without them."""
    namespace = jobset["metadata"]["namespace"]
    keys: dict[str, set[str]] = {}
    for replicated in (jobset.get("spec") or {}).get("replicatedJobs") or []:
        pod_spec = replicated["template"]["spec"]["template"]["spec"]
        for container in pod_spec.get("containers") or []:
            for variable in container.get("env") or []:
                ref = (variable.get("valueFrom") or {}).get("secretKeyRef")
                if ref:
                    keys.setdefault(ref["name"], set()).add(ref["key"])
    for name, names in keys.items():
        data = {k: base64.b64encode(b"placeholder").decode() for k in sorted(names)}
        metadata = {"name": name, "namespace": namespace}
        kube.put({"apiVersion": "v1", "kind": "Secret", "metadata": metadata, "data": data})


class JobSetPlayer:
    def __init__(
        self,
        kube: KubeEmulator,
        kubelet: Kubelet | None = None,
        interval_s: float = 0.05,
        *,
        restart_job_gate: bool = True,
    ) -> None:
        self.kube = kube
        self.kubelet = kubelet
        self.core = kubernetes.client.CoreV1Api(kube.api_client)
        self.interval_s = interval_s
        self.restart_job_gate = restart_job_gate  # JobSet's feature gate RestartJob
        # (namespace, jobset, attempt) -> the pods created for it, and the child Job each belongs to
        self.created: dict[tuple[str, str, int], dict[str, ChildJob]] = {}
        self.restarts = 0  # whole restarts this player made, in all
        self.job_restarts = 0  # child Jobs it recreated alone, in all
        self.refused: list[str] = []  # RestartJob actions refused with the gate off: the Jobs they were for
        self.started: dict[tuple[str, str], Json] = {}  # (namespace, pod) -> the pod, as its kubelet started it
        self._failed_order = itertools.count()
        self._failed_at: dict[tuple[str, str, int, ChildJob], int] = {}  # when each failed Job was first seen failed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="jobset-player", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.kubelet is not None:
            for pod in self.started.values():
                self.kubelet.stop(pod)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.step()
            except Exception:
                log.exception("the JobSet player's pass failed")

    def step(self) -> None:
        with self._lock:
            for jobset in self.kube.objects("jobsets.jobset.x-k8s.io"):
                self._jobset(jobset)
            self._reap()

    def _reap(self) -> None:
        """A pod gone from the API server (deleted, evicted, force-deleted) has its containers stopped."""
        if self.kubelet is None:
            return
        present = {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in self.kube.objects("pods")}
        for key in [k for k in self.started if k not in present]:
            self.kubelet.stop(self.started.pop(key))

    # -- the JobSet controller -----------------------------------------------------------------------------------
    def _jobset(self, jobset: Json) -> None:
        meta = jobset["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        status = jobset.get("status") or {}
        if conditions(jobset).get("Completed") == "True":
            return
        attempt = int(status.get("restarts", 0))
        targets = job_restarts(jobset) if self.restart_job_gate else {}
        pods = [p for p in self.kube.objects("pods", namespace) if self._label(p, JOBSET_NAME_LABEL) == name]
        if self._retire(namespace, [p for p in pods if attempt_of(p) < attempt]):
            return  # the Jobs of earlier attempts are still being deleted: their names are not free yet
        # the pods of Jobs recreated alone since: deleted first; their Jobs wait until they are gone
        superseded = [
            p for p in pods if attempt_of(p) == attempt and self._job_of(p).job_attempt < self._target(p, targets)
        ]
        waiting = {(j.replicated_job, j.index) for j in map(self._job_of, superseded)}
        self._retire(namespace, superseded)
        mine = {p["metadata"]["name"]: p for p in pods if attempt_of(p) == attempt}
        created = self.created.setdefault((namespace, name, attempt), {})
        if self._fail(jobset, attempt, targets, created, mine):
            return
        self._create_pods(jobset, attempt, targets, set(mine), waiting)
        self._schedule(namespace, name, attempt)
        self._run_pods(namespace, name, attempt)
        current = [
            p
            for p in self._attempt_pods(namespace, name, attempt)
            if self._job_of(p).job_attempt == self._target(p, targets)
        ]
        done = [p for p in current if (p.get("status") or {}).get("phase") == "Succeeded"]
        if done and len(done) == self._expected(jobset):
            self._set_status(jobset, {**status, "conditions": [{"type": "Completed", "status": "True"}]})

    def _fail(
        self,
        jobset: Json,
        attempt: int,
        targets: dict[str, list[int]],
        created: dict[str, ChildJob],
        mine: dict[str, Json],
    ) -> bool:
        """The failure policy applied to the first failed Job of the current ones, if any; whether it acted."""
        meta, status = jobset["metadata"], jobset.get("status") or {}
        namespace, name = meta["namespace"], meta["name"]
        failed: dict[ChildJob, str] = {}  # the current Jobs failed, and why
        for pod_name, job in sorted(created.items()):
            if self.restart_job_gate and job.job_attempt != targets[job.replicated_job][job.index]:
                continue  # a Job recreated since
            pod = mine.get(pod_name)
            state = pod if pod is not None else self.kube.last_state("pods", namespace, pod_name) or {}
            disrupted = conditions(state).get("DisruptionTarget") == "True"
            if pod is not None and not disrupted and (pod.get("status") or {}).get("phase") != "Failed":
                continue
            reason = (
                POD_FAILURE_POLICY if disrupted and self._fails_on_disruption(jobset, job) else BACKOFF_LIMIT_EXCEEDED
            )
            failed.setdefault(job, reason)
            self._failed_at.setdefault((namespace, name, attempt, job), next(self._failed_order))
        if not failed:
            return False
        first = sorted(failed, key=lambda j: self._failed_at[(namespace, name, attempt, j)])
        # JobSet's rule loop: the first rule that applies to any failed Job, on the one of them that failed first
        action, job = None, first[0]
        for rule in ((jobset.get("spec") or {}).get("failurePolicy") or {}).get("rules") or []:
            matching = [j for j in first if rule_applies(rule, j.replicated_job, failed[j])]
            if matching:
                action, job = str(rule.get("action")), matching[0]
                break
        jobname = f"{name}-{job.replicated_job}-{job.index}"
        if action in RESTART_JOB_ACTIONS:
            if not self.restart_job_gate:
                if jobname not in self.refused:
                    log.error(
                        "JobSet %s/%s: %s refused: the feature gate RestartJob is disabled", namespace, name, action
                    )
                    self.refused.append(jobname)
                return True
            log.info("JobSet %s/%s: Job %s failed (%s): %s", namespace, name, jobname, failed[job], action)
            counts = {**targets, job.replicated_job: list(targets[job.replicated_job])}
            counts[job.replicated_job][job.index] += 1
            self.job_restarts += 1
            self._set_status(jobset, {**status, "replicatedJobsStatus": self._statuses(status, counts)})
            return True
        log.info("JobSet %s/%s: Job %s failed (%s): restart %d", namespace, name, jobname, failed[job], attempt + 1)
        self.restarts += 1
        self._set_status(jobset, {**status, "restarts": attempt + 1})
        return True

    @staticmethod
    def _statuses(status: Json, counts: dict[str, list[int]]) -> list[Json]:
        """``status.replicatedJobsStatus`` with ``jobRestarts`` set to ``counts``, the other fields kept."""
        known = {s.get("name"): s for s in status.get("replicatedJobsStatus") or []}
        return [{**(known.get(rj) or {"name": rj}), "jobRestarts": n} for rj, n in counts.items()]

    @staticmethod
    def _fails_on_disruption(jobset: Json, job: ChildJob) -> bool:
        for rj in (jobset.get("spec") or {}).get("replicatedJobs") or []:
            if rj["name"] == job.replicated_job:
                return fails_job_on_disruption((rj.get("template") or {}).get("spec") or {})
        return False

    @staticmethod
    def _job_of(pod: Json) -> ChildJob:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        return ChildJob(
            labels.get(REPLICATED_JOB_LABEL, ""),
            label_int(pod, JOB_INDEX_LABEL, 0),
            label_int(pod, JOB_RESTART_ATTEMPT_LABEL, 0),
        )

    def _target(self, pod: Json, targets: dict[str, list[int]]) -> int:
        """The restart count of the pod's Job now (0 with the gate off: Jobs are never recreated alone)."""
        job = self._job_of(pod)
        counts = targets.get(job.replicated_job) or []
        return counts[job.index] if 0 <= job.index < len(counts) else 0

    @staticmethod
    def _expected(jobset: Json) -> int:
        return sum(
            int(rj.get("replicas", 1)) * int(((rj.get("template") or {}).get("spec") or {}).get("parallelism", 1))
            for rj in (jobset.get("spec") or {}).get("replicatedJobs") or []
        )

    def _retire(self, namespace: str, old: list[Json]) -> bool:
        """Delete the pods of earlier attempts as the foreground deletion of their Jobs does (gracefully: a pod
        whose node does not answer stays Terminating); whether any is still there."""
        left = False
        for pod in old:
            name = pod["metadata"]["name"]
            if not pod["metadata"].get("deletionTimestamp"):
                try:
                    self.core.delete_namespaced_pod(name, namespace)
                except ApiException as exc:
                    if exc.status != 404:
                        raise
            if self.kube.get("pods", namespace, name) is not None:
                left = True
        return left

    def _set_status(self, jobset: Json, status: Json) -> None:
        current = self.kube.get("jobsets.jobset.x-k8s.io", jobset["metadata"]["namespace"], jobset["metadata"]["name"])
        if current is not None:
            self.kube.put({**current, "status": status})

    def _create_pods(
        self,
        jobset: Json,
        attempt: int,
        targets: dict[str, list[int]],
        existing: set[str],
        waiting: set[tuple[str, int]],
    ) -> None:
        """The pods of the current Jobs not made yet, but of the Jobs ``waiting`` for their old pods to go."""
        meta = jobset["metadata"]
        created = self.created[(meta["namespace"], meta["name"], attempt)]
        for rj in (jobset.get("spec") or {}).get("replicatedJobs") or []:
            job_spec = (rj.get("template") or {}).get("spec") or {}
            pod_template = job_spec.get("template") or {}
            for job_index in range(int(rj.get("replicas", 1))):
                if (rj["name"], job_index) in waiting:
                    continue
                job_attempt = targets[rj["name"]][job_index] if self.restart_job_gate else 0
                for completion in range(int(job_spec.get("parallelism", 1))):
                    pod_name = f"{meta['name']}-{rj['name']}-{job_index}-{completion}-{attempt}"
                    pod_name += f"-{job_attempt}" if job_attempt else ""
                    if pod_name in existing or pod_name in created:
                        continue
                    labels = {
                        **((pod_template.get("metadata") or {}).get("labels") or {}),
                        JOBSET_NAME_LABEL: meta["name"],
                        REPLICATED_JOB_LABEL: rj["name"],
                        JOB_INDEX_LABEL: str(job_index),
                        RESTART_ATTEMPT_LABEL: str(attempt),
                        COMPLETION_INDEX: str(completion),
                    }
                    if self.restart_job_gate:
                        labels[JOB_RESTART_ATTEMPT_LABEL] = str(job_attempt)
                    annotations = {
                        **((pod_template.get("metadata") or {}).get("annotations") or {}),
                        COMPLETION_INDEX: str(completion),
                    }
                    self.kube.put(
                        {
                            "apiVersion": "v1",
                            "kind": "Pod",
                            "metadata": {
                                "name": pod_name,
                                "namespace": meta["namespace"],
                                "labels": labels,
                                "annotations": annotations,
                            },
                            "spec": {**(pod_template.get("spec") or {})},
                            "status": {"phase": "Pending"},
                        }
                    )
                    created[pod_name] = ChildJob(rj["name"], job_index, job_attempt)

    # -- the scheduler and the kubelet ---------------------------------------------------------------------------
    def _schedule(self, namespace: str, name: str, attempt: int) -> None:
        pods = self._attempt_pods(namespace, name, attempt)
        taken = {(p.get("spec") or {}).get("nodeName") for p in pods} - {None}
        nodes = sorted(self.kube.objects("nodes"), key=lambda n: n["metadata"]["name"])
        for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
            if (pod.get("spec") or {}).get("nodeName"):
                continue
            candidates = [n for n in nodes if n["metadata"]["name"] not in taken and fits(n, pod)]
            if not candidates:
                continue
            node = max(candidates, key=lambda n: preference(n, pod))  # the first by name among equals
            taken.add(node["metadata"]["name"])
            self.kube.put({**pod, "spec": {**pod["spec"], "nodeName": node["metadata"]["name"]}})

    def _run_pods(self, namespace: str, name: str, attempt: int) -> None:
        jobset = self.kube.get("jobsets.jobset.x-k8s.io", namespace, name) or {}
        parallelism = {
            rj["name"]: int(((rj.get("template") or {}).get("spec") or {}).get("parallelism", 1))
            for rj in (jobset.get("spec") or {}).get("replicatedJobs") or []
        }
        for pod in sorted(self._attempt_pods(namespace, name, attempt), key=lambda p: p["metadata"]["name"]):
            node = (pod.get("spec") or {}).get("nodeName")
            phase = (pod.get("status") or {}).get("phase")
            if not node or phase in ("Succeeded", "Failed") or (pod["metadata"].get("deletionTimestamp")):
                continue
            if phase == "Pending":
                if secret_env(self.kube, namespace, pod) is None:
                    continue  # a Secret its variables name is missing: its kubelet waits (CreateContainerConfigError)
                if self.kubelet is not None:
                    job = self._job_of(pod)
                    index = job.index * parallelism.get(job.replicated_job, 1) + label_int(pod, COMPLETION_INDEX, 0)
                    self.kubelet.start(pod, node, index, attempt)
                    self.started[(namespace, pod["metadata"]["name"])] = pod
                self.kube.put({**pod, "status": {"phase": "Running"}})
                continue
            code = self.kubelet.exit_code(pod) if self.kubelet is not None else None
            if code is not None:
                self.kube.put({**pod, "status": {"phase": "Succeeded" if code == 0 else "Failed"}})

    def _attempt_pods(self, namespace: str, name: str, attempt: int) -> list[Json]:
        return [
            p
            for p in self.kube.objects("pods", namespace)
            if self._label(p, JOBSET_NAME_LABEL) == name and self._label(p, RESTART_ATTEMPT_LABEL) == str(attempt)
        ]

    @staticmethod
    def _label(obj: Json, key: str) -> str:
        labels: Mapping[str, str] = (obj.get("metadata") or {}).get("labels") or {}
        return labels.get(key, "")
