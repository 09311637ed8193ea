"""The cluster as the controller's state store sees it: the runs (JobSets annotated ``opsd.io/run``, or attached
with ``opsd runs attach NAMESPACE/JOBSET``) and the roles of the GPU nodes, brought in from the informers' caches
at every pass of ``Reconciler.sync``.

A node's role: ``cordoned`` when it carries opsd's quarantine taint (or is cordoned and opsd's state label says
quarantined); ``spare`` when it is in the spare pool (``opsd.io/pool=spare``: the cluster's pool, shared by the
runs); ``active`` for a run when it carries the run's label or runs one of its pods. A node a run's pods landed on
gets the run's label (``nodes.mark_active``), which the run's pods prefer when the JobSet restarts them: the run's
nodes are never labelled by hand. Other nodes are not the controller's business. A JobSet that completed or failed
ends its run.

A JobSet annotated ``opsd.io/replica-groups`` is a fault-tolerant run when it is laid out for it
(``jobsets.fault_tolerance``): its replica groups are its child Jobs, each launched at its Job's restart count, on
the nodes its pods run on (filled in once they are placed). One that is not laid out for it, or whose pods show
that JobSet's feature gate ``RestartJob`` is off (no ``job-restart-attempt`` label), is told to the operator once,
in the log and in a Warning Event on the JobSet (``OpsdNotFaultTolerant``, ``OpsdRestartJobOff``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from opsd.backends.kubernetes.backend import GATE_OFF, KubernetesBackend
from opsd.backends.kubernetes.cluster import (
    CHECKPOINT_URL_ANNOTATION,
    JOBSET_NAME_LABEL,
    MIN_NODES_ANNOTATION,
    ON_NO_SPARE_ANNOTATION,
    POOL_LABEL,
    QUARANTINE_TAINT,
    REASON_ANNOTATION,
    RUN_ANNOTATION,
    RUN_LABEL,
    SPARE_POOL,
    STATE_LABEL,
)
from opsd.backends.kubernetes.events import Target, tell
from opsd.backends.kubernetes.jobsets import (
    fault_tolerance,
    finished,
    groups_of,
    job_attempt_of,
    job_index_of,
    job_restarts,
    labels_job_restarts,
    terminating,
)
from opsd.backends.kubernetes.nodes import has_taint, mark_active
from opsd.backends.kubernetes.rank_keys import RankKeys
from opsd.backends.kubernetes.refs import RunRef
from opsd.backends.kubernetes.watch import Cache, Informer
from opsd.controller.rows import GroupLaunch, RunRow, RunSpec
from opsd.controller.state import StateStore
from opsd.errors import BodyError, OpsError
from opsd.policy.recovery import OnNoSpare
from opsd.protocol.states import NodeRole, RunState

log = logging.getLogger(__name__)

Json = dict[str, Any]


def run_spec(jobset: Json, attached: bool = False) -> RunSpec:
    """What the state store keeps of a run found in a JobSet (``attached``: one made a run by ``opsd runs
    attach``)."""
    meta = jobset.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    on_no_spare = annotations.get(ON_NO_SPARE_ANNOTATION, OnNoSpare.WAIT)
    try:
        min_nodes = max(1, int(annotations.get(MIN_NODES_ANNOTATION, "1")))
    except ValueError:
        min_nodes = 1
    groups, min_replicas, _ = fault_tolerance(jobset)
    return RunSpec(
        backend="kubernetes",
        checkpoint_url=annotations.get(CHECKPOINT_URL_ANNOTATION, ""),
        on_no_spare=OnNoSpare(on_no_spare) if on_no_spare in tuple(OnNoSpare) else OnNoSpare.WAIT,
        min_nodes=min_nodes,
        replica_groups=groups,
        min_replicas=min_replicas,
    ).with_own(RunRef(meta.get("namespace", ""), meta.get("name", ""), attached=attached))


def own_ref(spec: RunSpec) -> RunRef | None:
    """A run's JobSet as its spec keeps it; None for a spec of no JobSet (a run first heard of in a heartbeat)."""
    try:
        return spec.own_as(RunRef)
    except BodyError:
        return None


def placed_groups(jobset: Json, pods: list[Json]) -> dict[int, GroupLaunch]:
    """A fault-tolerant run's replica groups as the cluster has them: each at its Job's restart count (the launch its
    pods report), on the nodes that Job's running pods are placed on."""
    out = {}
    for g in range(groups_of(jobset)):
        launch = job_restarts(jobset, g)
        where = {
            (p.get("spec") or {}).get("nodeName") or ""
            for p in pods
            if job_index_of(p) == g and job_attempt_of(p) == launch and not terminating(p) and not finished(p)
        }
        out[g] = GroupLaunch(launch, tuple(sorted(where - {""})))
    return out


def run_name(jobset: Json) -> str | None:
    return ((jobset.get("metadata") or {}).get("annotations") or {}).get(RUN_ANNOTATION) or None


def jobset_state(jobset: Json) -> RunState | None:
    """A finished JobSet's run state (JobSet's conditions ``Completed`` / ``Failed``); None while it runs."""
    for condition in (jobset.get("status") or {}).get("conditions") or []:
        if condition.get("status") == "True" and condition.get("type") in ("Completed", "Failed"):
            return RunState.COMPLETED if condition["type"] == "Completed" else RunState.FAILED
    return None


class Reconciler:
    def __init__(
        self,
        store: StateStore,
        backend: KubernetesBackend,
        jobsets: Cache,
        pods: Cache,
        nodes: Informer,
        final_step: Callable[[str], int] | None = None,
        rank_keys: RankKeys | None = None,
    ) -> None:
        """``final_step``: where a run whose JobSet finished ended (the controller's ``final_step``: what its
        last launch reported); without it, the newest step the store has. ``rank_keys``: makes each run's key's
        Secret."""
        self.store = store
        self.backend = backend
        self.jobsets = jobsets
        self.pods = pods
        self.nodes = nodes
        self.final_step = final_step
        self.rank_keys = rank_keys
        self.told: set[str] = set()  # the warnings told (their Events' request ids), once each

    def runs(self) -> dict[str, Json]:
        """run -> its JobSet: the annotated ones, and the ones attached (recorded in the store)."""
        found: dict[str, Json] = {}
        attached = {(ref.namespace, ref.jobset): run for run, ref in self.attached().items()}
        for jobset in self.jobsets.objects():
            meta = jobset.get("metadata") or {}
            name = run_name(jobset) or attached.get((meta.get("namespace", ""), meta.get("name", "")))
            if name:
                found[name] = jobset
        return found

    def attached(self) -> dict[str, RunRef]:
        """The runs made of a JobSet by ``opsd runs attach``: run -> its JobSet."""
        refs = {r.id: own_ref(r.spec) for r in self.store.runs() if r.spec.backend == KubernetesBackend.name}
        return {run: ref for run, ref in refs.items() if ref is not None and ref.attached}

    def sync(self, now_s: float) -> None:
        """Runs and node roles from the cluster into the store; the backend learns where each run is."""
        runs = self.runs()
        for name, jobset in runs.items():
            row = self.store.run(name)
            known = own_ref(row.spec) if row is not None else None
            spec = run_spec(jobset, attached=known is not None and known.attached)
            ref = spec.own_as(RunRef)
            if row is None and self.store.create_run(name, spec, now_s):
                self.store.update_run(name, now_s, generation=1)  # the JobSet's first launch
                log.info("run %s found: JobSet %s/%s", name, ref.namespace, ref.jobset)
            elif row is not None and (row.spec != spec or row.generation < 1):  # first seen in a heartbeat, or edited
                self.store.update_run(name, now_s, spec=spec, generation=max(1, row.generation))
                log.info("run %s: the spec of JobSet %s/%s", name, ref.namespace, ref.jobset)
            self.backend.runs[name] = RunRef(ref.namespace, ref.jobset)
            if self.rank_keys is not None and jobset_state(jobset) is None:
                self.rank_keys.ensure(name, jobset)
            self._fault_tolerance(name, jobset, now_s)
            ended = jobset_state(jobset)
            row = self.store.run(name)
            if ended is not None and row is not None and not RunState(row.state).finished:
                final = self.final_step(name) if self.final_step is not None else int(row.last_step)
                self.store.update_run(name, now_s, state=ended, final_step=final)
                log.info("run %s: its JobSet is %s", name, ended)
        self._nodes(runs, now_s)

    def _fault_tolerance(self, run: str, jobset: Json, now_s: float) -> None:
        """A fault-tolerant run's groups filled in from the cluster where the store has none yet (or none placed);
        a JobSet not laid out for its replica groups, or whose JobSet controller does not recreate Jobs alone, told
        to the operator once."""
        meta = jobset.get("metadata") or {}
        namespace, name, uid = meta.get("namespace", ""), meta.get("name", ""), meta.get("uid") or meta.get("name")
        _, _, problem = fault_tolerance(jobset)
        if problem:
            self._warn(run, jobset, f"{uid}/not-fault-tolerant/{problem}", "OpsdNotFaultTolerant", problem, now_s)
            return
        row = self.store.run(run)
        if row is None or not row.spec.replicas.fault_tolerant:
            return
        pods = [
            p
            for p in self.pods.objects()
            if (p.get("metadata") or {}).get("namespace") == namespace
            and ((p.get("metadata") or {}).get("labels") or {}).get(JOBSET_NAME_LABEL) == name
        ]
        if pods and not any(labels_job_restarts(p) for p in pods):
            self._warn(run, jobset, f"{uid}/restart-job-off", "OpsdRestartJobOff", GATE_OFF, now_s)
        self._fill_groups(row, placed_groups(jobset, pods), now_s)

    def _fill_groups(self, row: RunRow, placed: dict[int, GroupLaunch], now_s: float) -> None:
        """The groups the store has not placed yet, from the cluster (once their pods are): a running run's only,
        and never a group waiting out of the quorum (its recovery owns it)."""
        if row.state != RunState.RUNNING:
            return
        groups = dict(row.groups)
        for g, launch in placed.items():
            known = groups.get(g)
            if (known is None or (not known.nodes and not known.out)) and launch.nodes:
                groups[g] = launch
        if groups != row.groups:
            self.store.update_run(row.id, now_s, groups=groups)
            log.info("run %s: replica groups placed: %s", row.id, {g: list(x.nodes) for g, x in groups.items()})

    def _warn(self, run: str, jobset: Json, request_id: str, reason: str, message: str, now_s: float) -> None:
        """``message`` in the log and in a Warning Event on the JobSet, once (the Event's name is its request id's)."""
        if request_id in self.told:
            return
        self.told.add(request_id)
        log.warning("run %s: %s", run, message)
        meta = jobset.get("metadata") or {}
        target = Target("JobSet", meta.get("name", ""), meta.get("namespace", ""), meta.get("uid", ""))
        tell(self.backend.api, [target], reason, message, request_id, now_s, warning=True)

    def _nodes(self, runs: dict[str, Json], now_s: float) -> None:
        by_jobset = {
            ((j.get("metadata") or {}).get("namespace"), (j.get("metadata") or {}).get("name")): run
            for run, j in runs.items()
        }
        hosting: dict[str, str] = {}  # node -> run whose pods it runs
        for pod in self.pods.objects():
            meta = pod.get("metadata") or {}
            run = by_jobset.get((meta.get("namespace"), (meta.get("labels") or {}).get(JOBSET_NAME_LABEL)))
            node = (pod.get("spec") or {}).get("nodeName")
            if run and node:
                hosting[node] = run
        for node in self.nodes.objects():
            name = node["metadata"]["name"]
            labels = node["metadata"].get("labels") or {}
            annotations = node["metadata"].get("annotations") or {}
            known = self.store.node(name)
            run = labels.get(RUN_LABEL) or hosting.get(name) or (known.run if known is not None else None)
            if has_taint(node, QUARANTINE_TAINT) or labels.get(STATE_LABEL) == "quarantined":
                fields: dict[str, Any] = {"role": NodeRole.CORDONED, "reason": annotations.get(REASON_ANNOTATION, "")}
            elif labels.get(POOL_LABEL) == SPARE_POOL:
                fields = {"role": NodeRole.SPARE, "run": None, "reason": ""}
            elif labels.get(RUN_LABEL) in runs or hosting.get(name) in runs:
                fields = {"role": NodeRole.ACTIVE, "run": run, "reason": ""}
            else:
                continue
            if "run" not in fields and run in runs:
                fields["run"] = run
            if known is None or any(getattr(known, k) != v for k, v in fields.items()):
                self.store.upsert_node(name, now_s, **fields)
            landed = hosting.get(name)
            if fields["role"] == NodeRole.ACTIVE and landed in runs and labels.get(RUN_LABEL) != landed:
                self._label(name, landed)

    def _label(self, node: str, run: str) -> None:
        try:
            if mark_active(self.backend.api, node, run):
                log.info("node %s: the pods of run %s landed there; labelled %s=%s", node, run, RUN_LABEL, run)
        except OpsError as exc:
            log.warning("node %s: cannot label it for run %s (next pass tries again): %s", node, run, exc)
