"""The Kubernetes backend's leader: what the replica that holds the Lease does (``KubernetesController``: the
informers, the reconciler, the detection pass, and what it takes up from the leader before it), and the checks and
labels around it. The process that campaigns and serves is ``opsd.runtime.kubernetes``.

Every replica serves the API (its ``/healthz`` for liveness). With leader election (``kubernetes.leader_election``:
a ``coordination.k8s.io/v1`` Lease, the client's ``LeaseLock``) one replica leads: it alone labels its pod
``opsd.io/role=leader`` (the chart's Service selects that label, so the agents' heartbeats and the CLI reach the
leader only), watches the cluster, runs the detection pass and the recoveries. On becoming leader it first goes on
with every recovery its predecessor left unfinished (the state store has each step recorded). A leader that cannot
renew its Lease exits at once (``os._exit``): its successor may already act, and nothing of a half-done step must
run on. Without leader election the one replica leads from the start.
"""

from __future__ import annotations

import logging
import threading
import time

from opsd.backends.kubernetes.api import KubeApi
from opsd.backends.kubernetes.backend import KubernetesBackend
from opsd.backends.kubernetes.cluster import (
    JOBSET_GROUP,
    JOBSET_MIN_RELEASE,
    JOBSET_NAME_LABEL,
    JOBSET_PLURAL,
    JOBSET_VERSION,
    ROLE_LABEL,
)
from opsd.backends.kubernetes.config import KubernetesConfig
from opsd.backends.kubernetes.rank_keys import RankKeys
from opsd.backends.kubernetes.runs import Reconciler
from opsd.backends.kubernetes.selectors import NodeSelector
from opsd.backends.kubernetes.watch import Cache, Informer, InformerSet
from opsd.controller.controller import Controller
from opsd.controller.incidents import failure_of, took_step, unfinished_incident
from opsd.errors import ConfigError, OpsError
from opsd.protocol.states import ActionKind, RunState

log = logging.getLogger(__name__)


def cluster_informers(api: KubeApi, config: KubernetesConfig) -> tuple[Informer, Cache, Cache]:
    """The leader's informers, not started yet: of the nodes opsd manages (``node_selector``), and of the JobSets'
    pods and the JobSets in ``watch_namespace`` (every namespace when empty; an informer of each kind per namespace
    when it names several), each watch opened again after ``watch_timeout_s``."""
    timeout = config.watch_timeout_s
    selector = NodeSelector.parse(config.node_selector)
    nodes = Informer(
        api,
        "nodes",
        lambda: api.nodes(selector.server_side),
        timeout_s=timeout,
        keep=selector.matches_node,
        label_selector=selector.server_side,
    )

    def pods(namespace: str) -> Informer:
        return Informer(
            api,
            "pods",
            lambda: api.all_pods(JOBSET_NAME_LABEL, namespace),
            timeout_s=timeout,
            namespace=namespace,
            label_selector=JOBSET_NAME_LABEL,
        )

    def jobsets(namespace: str) -> Informer:
        return Informer(api, "jobsets", lambda: api.jobsets_listed(namespace), timeout_s=timeout, namespace=namespace)

    namespaces = config.watch_namespaces
    if len(namespaces) <= 1:
        where = namespaces[0] if namespaces else ""
        return nodes, pods(where), jobsets(where)
    return (
        nodes,
        InformerSet("pods", [pods(n) for n in namespaces]),
        InformerSet("jobsets", [jobsets(n) for n in namespaces]),
    )


class KubernetesController:
    """The leader's work: informers, the reconciler, the detection pass; what a new leader takes up."""

    def __init__(self, controller: Controller, api: KubeApi, config: KubernetesConfig, tick_interval_s: float) -> None:
        self.controller = controller
        self.api = api
        self.config = config
        self.tick_interval_s = tick_interval_s
        backend = controller.backend
        assert isinstance(backend, KubernetesBackend)
        self.backend = backend
        self.nodes, self.pods, self.jobsets = cluster_informers(api, config)
        backend.node_cache = self.nodes  # the second witness of a silent node, read without an API call
        self.reconciler = Reconciler(
            controller.store,
            backend,
            self.jobsets,
            self.pods,
            self.nodes,
            final_step=controller.final_step,
            rank_keys=RankKeys(api, config.rank_secret),
        )
        self.stop = threading.Event()

    def lead(self) -> None:
        """Watch, take up what the last leader left, then pass after pass until stopped."""
        self.controller.store.reload()  # a leader before this one wrote to the shared store
        for informer in (self.nodes, self.pods, self.jobsets):
            informer.start()
        for informer in (self.nodes, self.pods, self.jobsets):
            informer.synced.wait(timeout=60)
        self.reconciler.sync(time.time())
        self.take_up(time.time())
        threading.Thread(target=self._sync_forever, name="opsd-reconcile", daemon=True).start()
        self.controller.tick_every(self.tick_interval_s, self.stop)

    def take_up(self, now_s: float) -> None:
        """Go on with the recoveries a previous leader left unfinished; a run left recovering with nothing to do
        (its relaunch was done) is running again. A run whose JobSet completed after its recovery began to stop the
        ranks (its new pods ran to their end before this leader led) has the recovery's last steps carried out too:
        they find what the cluster did (nothing left to evict, the restart attempt that completed) and record it."""
        store = self.controller.store
        for run in store.runs():
            state = RunState(run.state)
            if state not in (RunState.RECOVERING, RunState.WAITING_FOR_SPARE, RunState.COMPLETED):
                continue
            incident = unfinished_incident(store, run.id)
            if state == RunState.COMPLETED:
                if incident is not None and took_step(store, int(incident.id), ActionKind.STOP, begun=True):
                    log.warning("run %s completed during the recovery of incident %d", run.id, incident.id)
                    self.controller.recovery.start(run.id, int(incident.id), failure_of(incident), now_s)
                continue
            if incident is None:
                store.update_run(run.id, now_s, state=RunState.RUNNING)
                continue
            log.warning("run %s: the recovery of incident %d goes on under this leader", run.id, incident.id)
            self.controller.recovery.start(run.id, int(incident.id), failure_of(incident), now_s)

    def _sync_forever(self) -> None:
        while not self.stop.wait(self.config.resync_interval_s):
            try:
                self.reconciler.sync(time.time())
            except OpsError as exc:
                log.warning("reconciling the cluster: %s", exc)
            except Exception:
                log.exception("reconciling the cluster failed")

    def close(self) -> None:
        self.stop.set()
        for informer in (self.nodes, self.pods, self.jobsets):
            informer.stop()


def label_self(api: KubeApi, config: KubernetesConfig, role: str) -> None:
    """This replica's pod labelled leader or standby (the Service routes to the leader); nothing outside a pod."""
    if not config.pod_name:
        return
    try:
        api.label_pod(config.namespace, config.pod_name, {ROLE_LABEL: role})
    except OpsError as exc:
        log.warning("cannot label this pod %s: %s", role, exc)


def require_jobsets(api: KubeApi) -> None:
    """A ``ConfigError`` saying what to install when the cluster serves no JobSets (opsd's runs are JobSets)."""
    if not api.serves(JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL):
        raise ConfigError(
            f"this cluster serves no {JOBSET_PLURAL}.{JOBSET_GROUP}/{JOBSET_VERSION}: install JobSet"
            f" {JOBSET_MIN_RELEASE} or newer (https://jobset.sigs.k8s.io, docs/kubernetes.md), then start opsd again"
        )
