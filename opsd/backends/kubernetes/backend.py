"""The Kubernetes backend: the Backend port (``opsd.controller.port``) on a cluster whose training jobs are JobSets.

A run is a JobSet (``runs``: found by its ``opsd.io/run`` annotation, or attached). opsd never restarts a JobSet by
editing it: it evicts the run's pods (the Eviction API sets the pod condition ``DisruptionTarget``; with JobSet's
host-maintenance failure policy the job fails with ``PodFailurePolicy`` and the JobSet restarts every child Job,
without counting against ``maxRestarts``), and the new pods are scheduled afresh, away from a node it quarantined
and onto a spare it promoted. The port's steps, here:

- ``quarantine_node``: the node cordoned, tainted and labelled (``nodes.quarantine``), unless the circuit breaker
  says ``quarantines_per_hour`` nodes were quarantined in the last hour already;
- ``promote_spare``: the spare's taint off, the run's node label on (``nodes.promote``); ``release_node`` puts a
  node back in the spare pool;
- ``stop_ranks``: every running pod of the run evicted (a 429 from a PodDisruptionBudget: ``Failed``, transient);
- ``relaunch``: nothing to start (the JobSet does): it checks that the JobSet restarted, that every pod of the new
  restart attempt is placed (or ran to its end already), and on no quarantined node, and answers ``Pending`` until
  then; a pod of an earlier attempt stuck Terminating (its node does not answer) is force-deleted after
  ``force_delete_after_s``. Its ranks report the restart attempt as their launch (``OPSD_LAUNCH``, from the pod's
  label through the downward API);
- ``request_dump``: nothing: the controller knows the run's ranks from their heartbeats;
- ``inject``: not here (``UNSUPPORTED``).

Each step is idempotent on the cluster's own state (a node already quarantined is left alone, a pod already
evicted is not evicted again) and tells what it did in Kubernetes Events on the JobSet and the node
(``events``), named after its request id.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from opsd.backends.kubernetes import nodes
from opsd.backends.kubernetes.api import Json, KubeApi
from opsd.backends.kubernetes.config import KubernetesConfig
from opsd.backends.kubernetes.events import Target, recorded, tell
from opsd.controller.port import Done, ErrorKind, Failed, Fault, Outcome, Pending
from opsd.controller.steps import Step, as_outcome
from opsd.errors import NotFoundError
from opsd.protocol.cluster import (
    JOB_INDEX_LABEL,
    JOB_RESTART_ATTEMPT_LABEL,
    JOBSET_NAME_LABEL,
    QUARANTINE_TAINT,
    RESTART_ATTEMPT_LABEL,
)

log = logging.getLogger(__name__)

HOUR_S = 3600.0
ATTEMPT_ANNOTATION = "opsd.io/restart-attempt"  # on a stop's Event: the attempt it evicts


@dataclass(frozen=True)
class RunRef:
    """Where a run is: its JobSet."""

    namespace: str
    jobset: str


def attempt_of(pod: Json) -> int:
    try:
        return int(((pod.get("metadata") or {}).get("labels") or {}).get(RESTART_ATTEMPT_LABEL, "0"))
    except ValueError:
        return 0


def terminating(pod: Json) -> bool:
    return bool((pod.get("metadata") or {}).get("deletionTimestamp"))


def finished(pod: Json) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def succeeded(pod: Json) -> bool:
    return (pod.get("status") or {}).get("phase") == "Succeeded"


def job_index_of(pod: Json) -> int | None:
    """A pod's child Job's index in its replicated job: a fault-tolerant run's replica group."""
    try:
        return int(((pod.get("metadata") or {}).get("labels") or {})[JOB_INDEX_LABEL])
    except (KeyError, ValueError):
        return None


def job_attempt_of(pod: Json) -> int:
    """How many times JobSet recreated the pod's child Job alone, when the pod was made."""
    try:
        return int(((pod.get("metadata") or {}).get("labels") or {}).get(JOB_RESTART_ATTEMPT_LABEL, "0"))
    except ValueError:
        return 0


def job_restarts(jobset: Json, index: int) -> int:
    """How many times JobSet recreated child Job ``index`` alone (its first replicated job's ``jobRestarts``)."""
    statuses = (jobset.get("status") or {}).get("replicatedJobsStatus") or []
    restarts = (statuses[0].get("jobRestarts") or []) if statuses else []
    return int(restarts[index]) if 0 <= index < len(restarts) else 0


def group_pods(jobset: Json) -> int:
    """The pods of one child Job (a replica group): its parallelism."""
    jobs = (jobset.get("spec") or {}).get("replicatedJobs") or []
    job_spec = ((jobs[0].get("template") or {}).get("spec")) or {} if jobs else {}
    return int(job_spec.get("parallelism", 1))


def expected_pods(jobset: Json) -> int:
    """The pods a JobSet runs at once: each replicated Job's replicas times its parallelism."""
    total = 0
    for rj in (jobset.get("spec") or {}).get("replicatedJobs") or []:
        job_spec = ((rj.get("template") or {}).get("spec")) or {}
        total += int(rj.get("replicas", 1)) * int(job_spec.get("parallelism", 1))
    return total


class KubernetesBackend:
    name = "kubernetes"

    def __init__(self, api: KubeApi, config: KubernetesConfig, clock: Callable[[], float] = time.time) -> None:
        self.api = api
        self.config = config
        self.clock = clock
        self.runs: dict[str, RunRef] = {}  # filled by the reconciler (opsd.backends.kubernetes.runs)
        self._lock = threading.Lock()

    # -- the port ----------------------------------------------------------------------------------------------
    def stop_ranks(self, run: str, request_id: str, group: int | None = None) -> Outcome:
        if group is not None:
            return self._step(f"stop {run} group {group}", lambda: self._stop_group(run, group, request_id))
        return self._step(f"stop {run}", lambda: self._stop(run, request_id))

    def quarantine_node(self, run: str, node: str, reason: str, request_id: str) -> Outcome:
        return self._step(f"quarantine {node}", lambda: self._quarantine(run, node, reason, request_id))

    def release_node(self, node: str, request_id: str) -> Outcome:
        def release() -> Outcome:
            changed = nodes.release(self.api, node)
            if changed:
                tell(
                    self.api, [Target("Node", node)], "OpsdReleased", "back in the spare pool", request_id, self.clock()
                )
            return Done({"changed": changed})

        return self._step(f"release {node}", release)

    def promote_spare(self, run: str, spare: str, replaces: str, request_id: str) -> Outcome:
        def promote() -> Outcome:
            changed = nodes.promote(self.api, spare, run)
            message = f"spare {spare} promoted into run {run} in place of {replaces}"
            tell(
                self.api,
                [Target("Node", spare), *self._jobset_target(run)],
                "OpsdPromoteSpare",
                message,
                request_id,
                self.clock(),
            )
            return Done({"changed": changed})

        return self._step(f"promote {spare}", promote)

    def relaunch(
        self, run: str, generation: int, nodes_: Sequence[str], request_id: str, group: int | None = None
    ) -> Outcome:
        if group is not None:
            return self._step(f"relaunch {run} group {group}", lambda: self._verify_group(run, group, request_id))
        return self._step(f"relaunch {run}", lambda: self._verify_restart(run, request_id))

    def request_dump(self, run: str, trigger: str, request_id: str) -> Outcome:
        return Done({"ranks": None})  # the controller asks the ranks it hears from

    def inject(self, run: str, fault: Fault, request_id: str) -> Outcome:
        return Failed(ErrorKind.UNSUPPORTED, "fault injection needs the local backend (opsd run)")

    def resumed_from(self, run: str) -> int | None:
        return None  # the ranks say it in their reports

    # -- the steps ---------------------------------------------------------------------------------------------
    def _ref(self, run: str) -> RunRef:
        ref = self.runs.get(run)
        if ref is None:
            raise NotFoundError(f"run {run!r} is no JobSet opsd knows")
        return ref

    def _jobset_target(self, run: str) -> list[Target]:
        ref = self.runs.get(run)
        return [Target("JobSet", ref.jobset, ref.namespace)] if ref is not None else []

    def _pods(self, ref: RunRef) -> list[Json]:
        return self.api.pods(ref.namespace, f"{JOBSET_NAME_LABEL}={ref.jobset}")

    def _stop(self, run: str, request_id: str) -> Outcome:
        """Evict the running pods of the run's current restart attempt. The attempt is written first, in the step's
        Event on the JobSet: a stop told again (after a controller's restart) evicts what is left of that attempt,
        never the pods of the attempt the JobSet started since."""
        ref = self._ref(run)
        target = Target("JobSet", ref.jobset, ref.namespace)
        pods = self._pods(ref)
        record = recorded(self.api, target, request_id)
        if record is not None:
            attempt = int(((record.get("metadata") or {}).get("annotations") or {}).get(ATTEMPT_ANNOTATION, "0"))
        else:
            jobset = self.api.jobset(ref.namespace, ref.jobset)
            attempt = int((jobset.get("status") or {}).get("restarts", 0))
            message = f"evicting the pods of restart attempt {attempt}: the JobSet restarts"
            self._tell([target], "OpsdEvict", message, request_id, annotations={ATTEMPT_ANNOTATION: str(attempt)})
        running = [p for p in pods if attempt_of(p) <= attempt and not terminating(p) and not finished(p)]
        for pod in running:
            try:
                self.api.evict(ref.namespace, pod["metadata"]["name"])
            except NotFoundError:
                continue  # gone meanwhile
        return Done({"killed": len(running), "restart_attempt": attempt, "launch": attempt})

    def _stop_group(self, run: str, group: int, request_id: str) -> Outcome:
        """Evict the running pods of replica group ``group`` (the child Job of that index) at its current
        restart: JobSet's ``RestartJob`` failure policy recreates that Job alone; the other groups train on. The
        Job's restart attempt is written first, in the step's Event, as for a whole stop."""
        ref = self._ref(run)
        target = Target("JobSet", ref.jobset, ref.namespace)
        mine = [p for p in self._pods(ref) if job_index_of(p) == group]
        record = recorded(self.api, target, request_id)
        if record is not None:
            attempt = int(((record.get("metadata") or {}).get("annotations") or {}).get(ATTEMPT_ANNOTATION, "0"))
        else:
            attempt = job_restarts(self.api.jobset(ref.namespace, ref.jobset), group)
            message = f"evicting the pods of replica group {group} (its job's restart {attempt}): the Job restarts"
            self._tell([target], "OpsdEvict", message, request_id, annotations={ATTEMPT_ANNOTATION: str(attempt)})
        running = [p for p in mine if job_attempt_of(p) <= attempt and not terminating(p) and not finished(p)]
        for pod in running:
            try:
                self.api.evict(ref.namespace, pod["metadata"]["name"])
            except NotFoundError:
                continue  # gone meanwhile
        return Done({"killed": len(running), "restart_attempt": attempt, "launch": attempt})

    def _verify_group(self, run: str, group: int, request_id: str) -> Outcome:
        """Replica group ``group``'s Job was recreated (its restart attempt went up), every pod of it is placed, on
        no quarantined node, and none of its earlier attempt is left."""
        ref = self._ref(run)
        jobset = self.api.jobset(ref.namespace, ref.jobset)
        target = job_restarts(jobset, group)
        mine = [p for p in self._pods(ref) if job_index_of(p) == group]
        now = self.clock()
        old = [p for p in mine if job_attempt_of(p) < target and not finished(p)]
        for pod in old:
            self._force_if_stuck(ref, pod, now)
        current = [
            p for p in mine if job_attempt_of(p) == target and not terminating(p) and (succeeded(p) or not finished(p))
        ]
        wanted = group_pods(jobset)
        placed = {p["metadata"]["name"]: (p.get("spec") or {}).get("nodeName") for p in current}
        where = sorted({n for n in placed.values() if n})
        bad = [n for n in where if nodes.unusable(self.api.node(n))]
        if target == 0 or old or len(current) < wanted or not all(placed.values()) or bad:
            why = (
                f"replica group {group}, its job's restart {target}: {len(where)} of {wanted} pods placed"
                + (f", {len(old)} of earlier attempts still there" if old else "")
                + (f", pods on unusable nodes {bad}" if bad else "")
            )
            return Pending(why, retry_after_s=1.0)
        message = f"replica group {group}, its job's restart {target}: {len(current)} pods on {', '.join(where)}"
        self._tell(self._jobset_target(run), "OpsdRestarted", message, request_id)
        return Done({"restart_attempt": target, "nodes": where, "pods": len(current), "launch": target})

    def _quarantine(self, run: str, node: str, reason: str, request_id: str) -> Outcome:
        current = self.api.node(node)
        if nodes.has_taint(current, QUARANTINE_TAINT):
            return Done({"changed": False})
        listed, _ = self.api.nodes(self.config.node_selector)
        recent = nodes.quarantined_since(listed, self.clock() - HOUR_S)
        if len(recent) >= self.config.quarantines_per_hour:
            message = (
                f"circuit breaker: {len(recent)} nodes quarantined in the last hour ({', '.join(recent)}),"
                f" at most {self.config.quarantines_per_hour}; {node} left in service: {reason}"
            )
            tell(
                self.api,
                [Target("Node", node), *self._jobset_target(run)],
                "OpsdCircuitBreaker",
                message,
                request_id,
                self.clock(),
                warning=True,
            )
            return Failed(ErrorKind.PERMANENT, message)
        cause = reason.split(":", 1)[0]
        changed = nodes.quarantine(self.api, node, cause=cause, reason=reason, incident=request_id, now_s=self.clock())
        message = f"quarantined by opsd: {reason}"
        tell(
            self.api,
            [Target("Node", node), *self._jobset_target(run)],
            "OpsdQuarantine",
            message,
            request_id,
            self.clock(),
            warning=True,
        )
        return Done({"changed": changed})

    def _verify_restart(self, run: str, request_id: str) -> Outcome:
        ref = self._ref(run)
        jobset = self.api.jobset(ref.namespace, ref.jobset)
        restarts = int((jobset.get("status") or {}).get("restarts", 0))
        pods = self._pods(ref)
        now = self.clock()
        old = [p for p in pods if attempt_of(p) < restarts and not finished(p)]
        for pod in old:
            self._force_if_stuck(ref, pod, now)
        # a pod of the attempt that ran to its end was launched (its ranks may finish before a new leader looks)
        current = [
            p for p in pods if attempt_of(p) == restarts and not terminating(p) and (succeeded(p) or not finished(p))
        ]
        wanted = expected_pods(jobset)
        placed = {p["metadata"]["name"]: (p.get("spec") or {}).get("nodeName") for p in current}
        where = sorted({n for n in placed.values() if n})
        bad = [n for n in where if nodes.unusable(self.api.node(n))]
        if old or len(current) < wanted or not all(placed.values()) or bad:
            why = (
                f"restart attempt {restarts}: {sum(1 for n in placed.values() if n)} of {wanted} pods placed"
                + (f", {len(old)} of earlier attempts still there" if old else "")
                + (f", pods on unusable nodes {bad}" if bad else "")
            )
            return Pending(why, retry_after_s=1.0)
        message = f"restart attempt {restarts}: {len(current)} pods on {', '.join(where)}"
        self._tell(self._jobset_target(run), "OpsdRestarted", message, request_id)
        return Done({"restart_attempt": restarts, "nodes": where, "pods": len(current), "launch": restarts})

    def _force_if_stuck(self, ref: RunRef, pod: Json, now_s: float) -> None:
        """A pod still Terminating ``force_delete_after_s`` past the end of its grace period (its
        ``deletionTimestamp``: its node does not answer) is deleted at once, so that its Job and the JobSet's
        restart are not held up."""
        since = nodes.parse_rfc3339(pod["metadata"].get("deletionTimestamp", ""))
        if since is not None and now_s - since >= self.config.force_delete_after_s:
            name = pod["metadata"]["name"]
            log.warning(
                "pod %s/%s Terminating %.0f s past its grace period: deleted at once",
                ref.namespace,
                name,
                now_s - since,
            )
            self.api.delete_pod_now(ref.namespace, name)

    def _tell(
        self,
        targets: list[Target],
        reason: str,
        message: str,
        request_id: str,
        *,
        warning: bool = False,
        annotations: dict[str, str] | None = None,
    ) -> None:
        tell(self.api, targets, reason, message, request_id, self.clock(), warning=warning, annotations=annotations)

    def _step(self, what: str, step: Step) -> Outcome:
        """A step's outcome, opsd's errors as data (the port's contract); one step at a time. Idempotent on the
        cluster's own state (the request id is in each step's Event), not in memory."""
        with self._lock:
            return as_outcome(what, step)
