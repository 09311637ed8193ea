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
- a fault-tolerant run's replica group ``g`` (``group=g``) is the child Job of index ``g``: its pods alone are evicted,
  JobSet's ``RestartJob`` failure policy recreates that Job alone, and the relaunch waits for its restart count
  (``jobRestarts[g]``) to go up. Its ranks report that count as their launch (the pod's ``job-restart-attempt``
  label). The whole job of such a JobSet (which never restarts whole) is every group's Job stopped and recreated
  alone, each at its own count (``launches``, one per group; ``jobsets`` says why);
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
from typing import TypeVar

from opsd.backends.kubernetes import nodes
from opsd.backends.kubernetes.api import Json, KubeApi
from opsd.backends.kubernetes.cluster import JOBSET_NAME_LABEL, JOBSET_RESTART_JOB_RELEASE, QUARANTINE_TAINT
from opsd.backends.kubernetes.config import KubernetesConfig
from opsd.backends.kubernetes.events import Target, recorded, tell
from opsd.backends.kubernetes.jobsets import (
    attempt_of,
    expected_pods,
    finished,
    group_pods,
    groups_of,
    job_attempt_of,
    job_index_of,
    job_restarts,
    labels_job_restarts,
    restarts_jobs_alone,
    succeeded,
    terminating,
)
from opsd.backends.kubernetes.refs import RunRef, attached_ref
from opsd.backends.kubernetes.selectors import NodeSelector
from opsd.backends.kubernetes.watch import Informer
from opsd.controller.port import Done, ErrorKind, Failed, Fault, Outcome, Pending
from opsd.controller.rows import RunSpec
from opsd.controller.steps import Step, as_outcome
from opsd.errors import NotFoundError, OpsError
from opsd.protocol.steps import DumpReady, Injected, Launched, NodeChanged, Stopped

log = logging.getLogger(__name__)
T = TypeVar("T")

HOUR_S = 3600.0
ATTEMPT_ANNOTATION = "opsd.io/restart-attempt"  # on a stop's Event: the attempt it evicts
#: on a whole stop's Event of a JobSet that recreates its Jobs alone: each Job's restart count it evicts ("0,2")
JOB_RESTARTS_ANNOTATION = "opsd.io/job-restarts"
GATE_OFF = (
    f"no pod carries jobset.sigs.k8s.io/job-restart-attempt: JobSet's feature gate RestartJob is off (it needs"
    f" JobSet {JOBSET_RESTART_JOB_RELEASE} or newer with featureGates RestartJob: true, docs/kubernetes.md), and"
    f" no failed Job is recreated alone"
)


@dataclass(frozen=True)
class GroupState:
    """A replica group's child Job as the cluster has it now (``KubernetesBackend._group_now``)."""

    restarts: int  # its Job's restart count (jobRestarts): the launch of its current pods
    pods: int  # its current pods, not stopping
    nodes: tuple[str, ...]  # where those are placed
    placed: bool  # every one of them is
    old: int  # pods of its earlier restarts still there


class KubernetesBackend:
    name = "kubernetes"
    shares_spares = True  # the cluster's spare pool (opsd.io/pool=spare), of no run

    def __init__(self, api: KubeApi, config: KubernetesConfig, clock: Callable[[], float] = time.time) -> None:
        self.api = api
        self.config = config
        self.clock = clock
        self.runs: dict[str, RunRef] = {}  # filled by the reconciler (opsd.backends.kubernetes.runs)
        self.node_cache: Informer | None = None  # the leader's informer of the nodes: node_ready reads it, no call
        self._lock = threading.Lock()

    # -- the port ----------------------------------------------------------------------------------------------
    def stop_ranks(
        self, run: str, request_id: str, group: int | None = None, launch: int | None = None
    ) -> Outcome[Stopped]:
        if group is not None:
            return self._step(f"stop {run} group {group}", lambda: self._stop_group(run, group, request_id, launch))
        return self._step(f"stop {run}", lambda: self._stop(run, request_id))

    def quarantine_node(self, run: str, node: str, reason: str, request_id: str) -> Outcome[NodeChanged]:
        return self._step(f"quarantine {node}", lambda: self._quarantine(run, node, reason, request_id))

    def release_node(self, node: str, request_id: str) -> Outcome[NodeChanged]:
        def release() -> Outcome[NodeChanged]:
            changed = nodes.release(self.api, node)
            if changed:
                self._tell([Target("Node", node)], "OpsdReleased", "back in the spare pool", request_id)
            return Done(NodeChanged(changed=changed))

        return self._step(f"release {node}", release)

    def promote_spare(self, run: str, spare: str, replaces: str, request_id: str) -> Outcome[NodeChanged]:
        def promote() -> Outcome[NodeChanged]:
            changed = nodes.promote(self.api, spare, run)
            message = f"spare {spare} promoted into run {run} in place of {replaces}"
            self._tell(self._node_targets(spare, run), "OpsdPromoteSpare", message, request_id)
            return Done(NodeChanged(changed=changed))

        return self._step(f"promote {spare}", promote)

    def relaunch(
        self,
        run: str,
        generation: int,
        nodes_: Sequence[str],
        request_id: str,
        group: int | None = None,
        stopped: int | None = None,
    ) -> Outcome[Launched]:
        if group is not None:
            return self._step(
                f"relaunch {run} group {group}", lambda: self._verify_group(run, group, request_id, stopped)
            )
        return self._step(f"relaunch {run}", lambda: self._verify_restart(run, request_id))

    def request_dump(self, run: str, trigger: str, request_id: str) -> Outcome[DumpReady]:
        return Done(DumpReady(ranks=None))  # the controller asks the ranks it hears from

    def inject(self, run: str, fault: Fault, request_id: str) -> Outcome[Injected]:
        return Failed(ErrorKind.UNSUPPORTED, "fault injection needs the local backend (opsd run)")

    def node_ready(self, node: str) -> bool | None:
        """The Node's ``Ready`` condition (a node deleted is down), from the leader's informer once it has listed
        (a roll of the agents silences many nodes at once: no API call for each of them at every detection pass);
        else read from the API; None when the API cannot be read."""
        cache = self.node_cache
        if cache is not None and cache.synced.is_set():
            found = cache.get(f"/{node}")
            return nodes.ready(found) if found is not None else False
        try:
            return nodes.ready(self.api.node(node))
        except NotFoundError:
            return False
        except OpsError:
            return None

    def resumed_from(self, run: str) -> int | None:
        return None  # the ranks say it in their reports

    def attach_spec(self, target: str) -> tuple[str, RunSpec]:
        """``NAMESPACE/JOBSET``: a JobSet made a run (``opsd runs attach``); the run's name defaults to the
        JobSet's."""
        ref = attached_ref(target)
        return ref.jobset, RunSpec(backend=self.name).with_own(ref)

    # -- the steps ---------------------------------------------------------------------------------------------
    def _ref(self, run: str) -> RunRef:
        ref = self.runs.get(run)
        if ref is None:
            raise NotFoundError(f"run {run!r} is no JobSet opsd knows")
        return ref

    def _jobset_target(self, run: str) -> list[Target]:
        ref = self.runs.get(run)
        return [Target("JobSet", ref.jobset, ref.namespace)] if ref is not None else []

    def _node_targets(self, node: str, run: str) -> list[Target]:
        """Where a step on ``node`` for ``run`` is told: the node, and the run's JobSet when it is known."""
        return [Target("Node", node), *self._jobset_target(run)]

    def _pods(self, ref: RunRef) -> list[Json]:
        return self.api.pods(ref.namespace, f"{JOBSET_NAME_LABEL}={ref.jobset}")

    def _stop(self, run: str, request_id: str) -> Outcome[Stopped]:
        """Evict the running pods of the run's current restart attempt. The attempt is written first, in the step's
        Event on the JobSet: a stop told again (after a controller's restart) evicts what is left of that attempt,
        never the pods of the attempt the JobSet started since. A JobSet that recreates its Jobs alone on an
        eviction (a fault-tolerant run's) never restarts whole: every replica group's Job is stopped at its own
        restart count instead (``_stop_every_group``)."""
        ref = self._ref(run)
        target = Target("JobSet", ref.jobset, ref.namespace)
        record = recorded(self.api, target, request_id)
        if record is not None:
            annotations = (record.get("metadata") or {}).get("annotations") or {}
            if JOB_RESTARTS_ANNOTATION in annotations:
                counts = [int(n) for n in annotations[JOB_RESTARTS_ANNOTATION].split(",") if n]
                return self._stop_every_group(ref, counts)
            attempt = int(annotations.get(ATTEMPT_ANNOTATION, "0"))
        else:
            jobset = self.api.jobset(ref.namespace, ref.jobset)
            if restarts_jobs_alone(jobset):
                counts = [job_restarts(jobset, g) for g in range(groups_of(jobset))]
                message = f"evicting the pods of every replica group (their jobs' restarts {counts}): each Job restarts"
                annotations = {JOB_RESTARTS_ANNOTATION: ",".join(map(str, counts))}
                self._tell([target], "OpsdEvict", message, request_id, annotations=annotations)
                return self._stop_every_group(ref, counts)
            attempt = int((jobset.get("status") or {}).get("restarts", 0))
            message = f"evicting the pods of restart attempt {attempt}: the JobSet restarts"
            self._tell([target], "OpsdEvict", message, request_id, annotations={ATTEMPT_ANNOTATION: str(attempt)})
        running = [p for p in self._pods(ref) if attempt_of(p) <= attempt and not terminating(p) and not finished(p)]
        self._evict(ref, running)
        return Done(Stopped(killed=len(running), restart_attempt=attempt, launch=attempt))

    def _stop_every_group(self, ref: RunRef, counts: list[int]) -> Outcome[Stopped]:
        """Evict the running pods of every replica group's Job at its restart count ``counts[g]`` (or before): each
        Job is recreated alone, and ``launches`` are the groups' launches stopped."""
        running = [
            p
            for p in self._pods(ref)
            if (g := job_index_of(p)) is not None
            and g < len(counts)
            and job_attempt_of(p) <= counts[g]
            and not terminating(p)
            and not finished(p)
        ]
        self._evict(ref, running)
        return Done(Stopped(killed=len(running), launches=counts))

    def _stop_group(self, run: str, group: int, request_id: str, launch: int | None) -> Outcome[Stopped]:
        """Evict the running pods of replica group ``group`` (the child Job of that index) at the restart its
        failure was seen in (``launch``; None: its current one): JobSet's ``RestartJob`` failure policy recreates
        that Job alone; the other groups train on. Where JobSet recreated the Job already (the failed pod's own exit
        restarted it), the newer pods are left be: one failure, one restart. A newer pod on a node that is no longer
        usable (quarantined by this recovery's cordon) is evicted too, so that the group leaves it. The Job's restart
        attempt is written first, in the step's Event, as for a whole stop."""
        ref = self._ref(run)
        target = Target("JobSet", ref.jobset, ref.namespace)
        mine = [p for p in self._pods(ref) if job_index_of(p) == group]
        record = recorded(self.api, target, request_id)
        if record is not None:
            attempt = int(((record.get("metadata") or {}).get("annotations") or {}).get(ATTEMPT_ANNOTATION, "0"))
        else:
            current = job_restarts(self.api.jobset(ref.namespace, ref.jobset), group)
            attempt = current if launch is None else min(launch, current)
            message = f"evicting the pods of replica group {group} (its job's restart {attempt}): the Job restarts"
            if current > attempt:
                message = (
                    f"replica group {group}'s job restarted already ({current}) since its failed restart {attempt}:"
                    " its pods of that restart are evicted, the newer ones left be"
                )
            self._tell([target], "OpsdEvict", message, request_id, annotations={ATTEMPT_ANNOTATION: str(attempt)})
        live = [p for p in mine if not terminating(p) and not finished(p)]
        running = [p for p in live if job_attempt_of(p) <= attempt or self._on_unusable_node(p)]
        self._evict(ref, running)
        return Done(Stopped(killed=len(running), restart_attempt=attempt, launch=attempt))

    def _on_unusable_node(self, pod: Json) -> bool:
        """Whether ``pod`` is placed on a node nothing may run on any more (quarantined, or gone)."""
        name = (pod.get("spec") or {}).get("nodeName")
        if not name:
            return False
        try:
            return nodes.unusable(self.api.node(name))
        except NotFoundError:
            return True

    def _evict(self, ref: RunRef, pods: list[Json]) -> None:
        for pod in pods:
            try:
                self.api.evict(ref.namespace, pod["metadata"]["name"])
            except NotFoundError:
                continue  # gone meanwhile

    def _group_now(self, ref: RunRef, jobset: Json, pods: list[Json], group: int, now_s: float) -> GroupState:
        """Replica group ``group`` as the cluster has it: its Job's restart count, the pods of that restart (placed
        or not, and on which nodes), and how many of its earlier restarts are left (a pod stuck Terminating past
        ``force_delete_after_s`` is deleted at once)."""
        restarts = job_restarts(jobset, group)
        mine = [p for p in pods if job_index_of(p) == group]
        old = [p for p in mine if job_attempt_of(p) < restarts and not finished(p)]
        for pod in old:
            self._force_if_stuck(ref, pod, now_s)
        # a pod of the restart that ran to its end was launched (its ranks may finish before a new leader looks)
        current = [
            p
            for p in mine
            if job_attempt_of(p) == restarts and not terminating(p) and (succeeded(p) or not finished(p))
        ]
        placed = [(p.get("spec") or {}).get("nodeName") or "" for p in current]
        return GroupState(restarts, len(current), tuple(sorted({n for n in placed if n})), all(placed), len(old))

    def _verify_group(self, run: str, group: int, request_id: str, stopped: int | None) -> Outcome[Launched]:
        """Replica group ``group``'s Job was recreated (its restart attempt went past ``stopped``, the one its stop
        ended; None: past 0), every pod of it is placed, on no quarantined node, and none of its earlier attempt is
        left."""
        ref = self._ref(run)
        jobset = self.api.jobset(ref.namespace, ref.jobset)
        pods = self._pods(ref)
        state = self._group_now(ref, jobset, pods, group, self.clock())
        wanted = group_pods(jobset)
        bad = [n for n in state.nodes if nodes.unusable(self.api.node(n))]
        if state.restarts <= (stopped or 0) or state.old or state.pods < wanted or not state.placed or bad:
            why = (
                f"replica group {group}, its job's restart {state.restarts}: {len(state.nodes)} of {wanted} pods placed"
                + (f", {state.old} of earlier attempts still there" if state.old else "")
                + (f", pods on unusable nodes {bad}" if bad else "")
                + (f"; {GATE_OFF}" if pods and not any(labels_job_restarts(p) for p in pods) else "")
            )
            return Pending(why, retry_after_s=1.0)
        where = list(state.nodes)
        message = f"replica group {group}, its job's restart {state.restarts}: {state.pods} pods on {', '.join(where)}"
        self._tell(self._jobset_target(run), "OpsdRestarted", message, request_id)
        return Done(Launched(restart_attempt=state.restarts, nodes=where, pods=state.pods, launch=state.restarts))

    def _quarantine(self, run: str, node: str, reason: str, request_id: str) -> Outcome[NodeChanged]:
        current = self.api.node(node)
        if nodes.has_taint(current, QUARANTINE_TAINT):
            return Done(NodeChanged(changed=False))
        selector = NodeSelector.parse(self.config.node_selector)
        listed = [node for node in self.api.nodes(selector.server_side)[0] if selector.matches_node(node)]
        recent = nodes.quarantined_since(listed, self.clock() - HOUR_S)
        if len(recent) >= self.config.quarantines_per_hour:
            message = (
                f"circuit breaker: {len(recent)} nodes quarantined in the last hour ({', '.join(recent)}),"
                f" at most {self.config.quarantines_per_hour}; {node} left in service: {reason}"
            )
            self._tell(self._node_targets(node, run), "OpsdCircuitBreaker", message, request_id, warning=True)
            return Failed(ErrorKind.PERMANENT, message)
        cause = reason.split(":", 1)[0]
        changed = nodes.quarantine(self.api, node, cause=cause, reason=reason, incident=request_id, now_s=self.clock())
        message = f"quarantined by opsd: {reason}"
        self._tell(self._node_targets(node, run), "OpsdQuarantine", message, request_id, warning=True)
        return Done(NodeChanged(changed=changed))

    def _verify_restart(self, run: str, request_id: str) -> Outcome[Launched]:
        ref = self._ref(run)
        jobset = self.api.jobset(ref.namespace, ref.jobset)
        if restarts_jobs_alone(jobset):
            return self._verify_every_group(run, ref, jobset, request_id)
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
        return Done(Launched(restart_attempt=restarts, nodes=where, pods=len(current), launch=restarts))

    def _verify_every_group(self, run: str, ref: RunRef, jobset: Json, request_id: str) -> Outcome[Launched]:
        """A whole relaunch of a JobSet that recreates its Jobs alone (``_stop_every_group``): every replica group's
        Job was recreated (none is back before it restarted once: its pods were evicted), every pod placed, on no
        quarantined node, none of an earlier restart left. ``launches`` and ``group_nodes``: each group's launch
        (its Job's restart count, its pods' ``job-restart-attempt``) and nodes."""
        pods = self._pods(ref)
        now = self.clock()
        states = [self._group_now(ref, jobset, pods, g, now) for g in range(groups_of(jobset))]
        wanted = group_pods(jobset)
        where = sorted({n for s in states for n in s.nodes})
        bad = [n for n in where if nodes.unusable(self.api.node(n))]
        waiting = [g for g, s in enumerate(states) if s.restarts == 0 or s.old or s.pods < wanted or not s.placed]
        if waiting or bad:
            why = (
                f"replica groups {waiting} not recreated yet (their jobs' restarts {[s.restarts for s in states]},"
                f" {sum(len(s.nodes) for s in states)} of {wanted * len(states)} pods placed)"
                + (f", pods on unusable nodes {bad}" if bad else "")
                + (f"; {GATE_OFF}" if pods and not any(labels_job_restarts(p) for p in pods) else "")
            )
            return Pending(why, retry_after_s=1.0)
        launches = [s.restarts for s in states]
        message = f"every replica group recreated (their jobs' restarts {launches}): pods on {', '.join(where)}"
        self._tell(self._jobset_target(run), "OpsdRestarted", message, request_id)
        return Done(
            Launched(
                nodes=where,
                pods=sum(s.pods for s in states),
                launches=launches,
                group_nodes=[list(s.nodes) for s in states],
            )
        )

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

    def _step(self, what: str, step: Step[T]) -> Outcome[T]:
        """A step's outcome, opsd's errors as data (the port's contract); one step at a time. Idempotent on the
        cluster's own state (the request id is in each step's Event), not in memory."""
        with self._lock:
            return as_outcome(what, step)
