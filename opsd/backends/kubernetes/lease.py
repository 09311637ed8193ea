"""Leader election on a ``coordination.k8s.io/v1`` Lease, through the official client's ``LeaseLock``: the second
module (with ``api``) that imports the client. The client's loop acquires the Lease, calls ``lead`` on a thread of
its own, renews every ``retry_period_s`` and returns when it could not renew within ``renew_deadline_s`` (or when
``lead`` raised): the replica must then exit, its successor may already act."""

from __future__ import annotations

import logging
from collections.abc import Callable

from kubernetes.leaderelection import electionconfig, leaderelection
from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

from opsd.backends.kubernetes.api import KubeApi
from opsd.backends.kubernetes.config import KubernetesConfig

log = logging.getLogger(__name__)


def elect(api: KubeApi, config: KubernetesConfig, identity: str, lead: Callable[[], None]) -> None:
    """Run for leader on the Lease; ``lead`` once elected. Returns only if leadership is lost (after which this
    process must exit)."""
    lock = LeaseLock(config.lease_name, config.namespace, identity)
    lock.api_instance = api.coordination  # the lock builds a client of the default configuration otherwise
    election = leaderelection.LeaderElection(
        electionconfig.Config(
            lock,
            lease_duration=config.lease_duration_s,
            renew_deadline=config.renew_deadline_s,
            retry_period=config.retry_period_s,
            onstarted_leading=lead,
            onstopped_leading=lambda: log.critical("%s lost the lease %s", identity, config.lease_name),
        )
    )
    election.run()
