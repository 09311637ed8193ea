"""``opsd serve --backend kubernetes``: a controller whose backend is the cluster, highly available.

Every replica serves the API (its ``/healthz`` for liveness). With leader election (``kubernetes.leader_election``:
a ``coordination.k8s.io/v1`` Lease, the client's ``LeaseLock``) one replica leads: it alone labels its pod
``opsd.io/role=leader`` (the chart's Service selects that label, so the agents' heartbeats and the CLI reach the
leader only), watches the cluster, runs the detection pass and the recoveries (``opsd.backends.kubernetes.leader``).
On becoming leader it first goes on with every recovery its predecessor left unfinished (the state store has each
step recorded). A leader that cannot renew its Lease exits at once (``os._exit``): its successor may already act,
and nothing of a half-done step must run on. Without leader election the one replica leads from the start.
"""

from __future__ import annotations

import logging
import os
import threading

from opsd.backends.kubernetes.api import KubeApi, connect
from opsd.backends.kubernetes.backend import KubernetesBackend
from opsd.backends.kubernetes.cluster import LEADER, STANDBY
from opsd.backends.kubernetes.config import KubernetesConfig
from opsd.backends.kubernetes.leader import KubernetesController, label_self, require_jobsets
from opsd.backends.kubernetes.lease import elect
from opsd.runtime.config import ServeConfig
from opsd.runtime.server import Serving, build

log = logging.getLogger(__name__)


def run_kubernetes(config: ServeConfig, kube: KubernetesConfig, *, api: KubeApi | None = None) -> None:
    """Check that the cluster serves JobSets, serve the API, lead (elected, or alone) until stopped; exit when
    leadership is lost."""
    api = api or KubeApi(connect(kube.kubeconfig, kube.context))
    require_jobsets(api)
    controller, credentials = build(config)
    controller.backend = KubernetesBackend(api, kube)
    leader = KubernetesController(controller, api, kube, config.tick_interval_s)
    identity = kube.pod_name or f"{os.uname().nodename}-{os.getpid()}"

    def lead() -> None:
        log.warning("%s leads", identity)
        label_self(api, kube, LEADER)
        leader.lead()

    def campaign(stop: threading.Event) -> None:
        if kube.leader_election:
            label_self(api, kube, STANDBY)
            elect(api, kube, identity, lead)
            log.critical("%s: leadership lost; exiting", identity)
            os._exit(1)
        lead()

    try:
        Serving(config, controller, credentials, lead=campaign, describe=f" (kubernetes) as {identity}").run()
    finally:
        leader.close()
