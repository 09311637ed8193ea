"""What the emulated API server has no controller for, played by the tests: the JobSet controller, the scheduler
and, given a ``Kubelet``, the kubelet (``JobSetPlayer``).

On every pass (``step``), for each JobSet of the emulator:

- JobSet controller: its restart attempt is ``status.restarts`` (0 at first). When a pod of the attempt it created
  is gone (an eviction deleted it), carries the condition ``DisruptionTarget``, or failed, the JobSet restarts as
  JobSet's host-maintenance failure policy makes it (``RestartJobSetAndIgnoreMaxRestarts``): ``status.restarts``
  goes up by one; the pods of earlier attempts are deleted through the API, gracefully, as the foreground
  deletion of their Jobs does (a pod marked ``stick_terminating`` stays Terminating until someone deletes it at
  once), and only once they are all gone (the Jobs' names are free again) are the pods of the new attempt
  created, labelled ``jobset.sigs.k8s.io/jobset-name`` and ``restart-attempt``, one per (replicated job, index),
  their spec from the template (containers, ``nodeSelector``, tolerations). Once every pod of the attempt
  succeeded, the JobSet gets the condition ``Completed``.
- scheduler: a pending pod goes to a node whose labels match its ``nodeSelector``, that is not unschedulable,
  whose ``NoSchedule`` / ``NoExecute`` taints it tolerates, and that runs no other pod of the attempt (one pod per
  node, as JobSet's exclusive placement); of those, the one its ``preferredDuringSchedulingIgnoredDuringExecution``
  node affinity scores highest (the sum of the weights of the terms it matches: ``In``, ``NotIn``, ``Exists``,
  ``DoesNotExist``, as the scheduler's NodeAffinity plugin), the first by name among equals; else it stays
  Pending.
- kubelet: a placed pod is started (``Kubelet.start``) and Running; its exit (``Kubelet.exit_code``) makes it
  Succeeded or Failed; a pod gone from the API server is stopped (``Kubelet.stop``).

Not played: Jobs (the pods are the JobSet's directly), backoff, gang scheduling, ``maxRestarts``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any, Protocol

import kubernetes.client
from kubernetes.client import ApiException

from opsd.protocol.cluster import JOBSET_NAME_LABEL, RESTART_ATTEMPT_LABEL
from tests.kube.emulator import KubeEmulator

log = logging.getLogger(__name__)

Json = dict[str, Any]
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"


class Kubelet(Protocol):
    """Runs a pod's containers on its node (the tests: real rank processes)."""

    def start(self, pod: Json, node: str, index: int, attempt: int) -> None: ...

    def exit_code(self, pod: Json) -> int | None: ...

    def stop(self, pod: Json) -> None: ...


def attempt_of(pod: Json) -> int:
    try:
        return int(((pod.get("metadata") or {}).get("labels") or {}).get(RESTART_ATTEMPT_LABEL, "-1"))
    except ValueError:
        return -1


def conditions(obj: Json) -> dict[str, str]:
    return {c.get("type", ""): c.get("status", "") for c in (obj.get("status") or {}).get("conditions") or []}


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


def fits(node: Json, pod: Json) -> bool:
    labels = (node.get("metadata") or {}).get("labels") or {}
    spec = pod.get("spec") or {}
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    if (node.get("spec") or {}).get("unschedulable"):
        return False
    taints = [t for t in (node.get("spec") or {}).get("taints") or [] if t.get("effect") in ("NoSchedule", "NoExecute")]
    return all(tolerated(t, spec.get("tolerations") or []) for t in taints)


class JobSetPlayer:
    def __init__(self, kube: KubeEmulator, kubelet: Kubelet | None = None, interval_s: float = 0.05) -> None:
        self.kube = kube
        self.kubelet = kubelet
        self.core = kubernetes.client.CoreV1Api(kube.api_client)
        self.interval_s = interval_s
        self.created: dict[tuple[str, str, int], set[str]] = {}  # (namespace, jobset, attempt) -> pods created
        self.restarts = 0  # restarts this player made, in all
        self.started: dict[tuple[str, str], Json] = {}  # (namespace, pod) -> the pod, as its kubelet started it
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
        pods = [p for p in self.kube.objects("pods", namespace) if self._label(p, JOBSET_NAME_LABEL) == name]
        if self._retire(namespace, [p for p in pods if attempt_of(p) < attempt]):
            return  # the Jobs of earlier attempts are still being deleted: their names are not free yet
        mine = {p["metadata"]["name"]: p for p in pods if attempt_of(p) == attempt}
        created = self.created.setdefault((namespace, name, attempt), set())
        failed = [
            n
            for n in created
            if n not in mine
            or conditions(mine[n]).get("DisruptionTarget") == "True"
            or (mine[n].get("status") or {}).get("phase") == "Failed"
        ]
        if failed:
            log.info("JobSet %s/%s: pods %s failed or were evicted: restart %d", namespace, name, failed, attempt + 1)
            self.restarts += 1
            self._set_status(jobset, {**status, "restarts": attempt + 1})
            return
        self._create_pods(jobset, attempt, set(mine))
        self._schedule(namespace, name, attempt)
        self._run_pods(namespace, name, attempt)
        current = self._attempt_pods(namespace, name, attempt)
        done = [p for p in current if (p.get("status") or {}).get("phase") == "Succeeded"]
        if created and len(done) == len(created):
            self._set_status(jobset, {**status, "conditions": [{"type": "Completed", "status": "True"}]})

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

    def _create_pods(self, jobset: Json, attempt: int, existing: set[str]) -> None:
        meta = jobset["metadata"]
        created = self.created[(meta["namespace"], meta["name"], attempt)]
        for rj in (jobset.get("spec") or {}).get("replicatedJobs") or []:
            job_spec = (rj.get("template") or {}).get("spec") or {}
            pod_template = job_spec.get("template") or {}
            for job_index in range(int(rj.get("replicas", 1))):
                for completion in range(int(job_spec.get("parallelism", 1))):
                    pod_name = f"{meta['name']}-{rj['name']}-{job_index}-{completion}-{attempt}"
                    if pod_name in existing or pod_name in created:
                        continue
                    labels = {
                        **((pod_template.get("metadata") or {}).get("labels") or {}),
                        JOBSET_NAME_LABEL: meta["name"],
                        REPLICATED_JOB_LABEL: rj["name"],
                        JOB_INDEX_LABEL: str(job_index),
                        RESTART_ATTEMPT_LABEL: str(attempt),
                    }
                    self.kube.put(
                        {
                            "apiVersion": "v1",
                            "kind": "Pod",
                            "metadata": {"name": pod_name, "namespace": meta["namespace"], "labels": labels},
                            "spec": {**(pod_template.get("spec") or {})},
                            "status": {"phase": "Pending"},
                        }
                    )
                    created.add(pod_name)

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
        pods = sorted(self._attempt_pods(namespace, name, attempt), key=lambda p: p["metadata"]["name"])
        for index, pod in enumerate(pods):
            node = (pod.get("spec") or {}).get("nodeName")
            phase = (pod.get("status") or {}).get("phase")
            if not node or phase in ("Succeeded", "Failed") or (pod["metadata"].get("deletionTimestamp")):
                continue
            if phase == "Pending":
                if self.kubelet is not None:
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
