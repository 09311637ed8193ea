"""The Kubernetes backend's configuration (``controller.kubernetes`` in the settings file, docs/configuration.md)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from opsd.backends.kubernetes.selectors import NodeSelector

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


@dataclass(frozen=True)
class KubernetesConfig:
    namespace: str = "default"  # the controller's own: its leader-election Lease and its pod
    watch_namespace: str = ""  # where the runs' JobSets are: a namespace, or several separated by "," ("": every one)
    # the nodes opsd manages: label selectors ORed, separated by ";" (``selectors``; "": every node)
    node_selector: str = "nvidia.com/gpu.present=true"
    kubeconfig: str = ""  # outside a cluster: the kubeconfig file ("": $KUBECONFIG or ~/.kube/config)
    context: str = ""  # and its context ("": the current one)
    leader_election: bool = False  # two or more replicas: one leads, on a coordination.k8s.io Lease
    lease_name: str = "opsd-leader"
    lease_duration_s: int = 15  # a leader that has not renewed for this long is replaced
    renew_deadline_s: int = 10  # a leader that cannot renew within this gives up (and exits)
    retry_period_s: int = 2  # between two tries to acquire or renew
    pod_name: str = ""  # this replica's pod (the downward API's metadata.name): labelled leader or standby
    quarantines_per_hour: int = 4  # the circuit breaker: no more nodes quarantined than this in an hour
    force_delete_after_s: float = 120.0  # a pod still Terminating this long past its grace period is deleted at once
    resync_interval_s: float = 5.0  # between two passes that bring runs and node roles from the cluster
    watch_timeout_s: int = 300  # a watch is opened again after this long (a fresh resourceVersion)
    rank_secret: str = ""  # the runs' keys derive from it: each run's is put in a Secret beside its JobSet

    def __post_init__(self) -> None:
        if not self.namespace:
            raise ValueError("kubernetes.namespace must not be empty")
        for namespace in self.watch_namespaces:
            if not _DNS_LABEL.fullmatch(namespace):
                raise ValueError(f"kubernetes.watch_namespace: {namespace!r} is not a namespace's name")
        try:
            NodeSelector.parse(self.node_selector)
        except ValueError as exc:
            raise ValueError(f"kubernetes.node_selector: {exc}") from None
        if self.lease_duration_s <= self.renew_deadline_s or self.renew_deadline_s <= self.retry_period_s:
            raise ValueError("kubernetes: lease_duration_s > renew_deadline_s > retry_period_s is needed")
        if self.retry_period_s < 1:
            raise ValueError("kubernetes.retry_period_s must be >= 1")
        if self.quarantines_per_hour < 0:
            raise ValueError("kubernetes.quarantines_per_hour must be >= 0")
        if self.force_delete_after_s < 0 or self.resync_interval_s <= 0 or self.watch_timeout_s < 1:
            raise ValueError("kubernetes: force_delete_after_s >= 0, resync_interval_s > 0, watch_timeout_s >= 1")

    @property
    def watch_namespaces(self) -> tuple[str, ...]:
        """The namespaces of ``watch_namespace``, in order; () for every namespace."""
        return tuple(dict.fromkeys(n.strip() for n in self.watch_namespace.split(",") if n.strip()))
