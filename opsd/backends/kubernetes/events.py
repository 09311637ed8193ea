"""Kubernetes Events for every step opsd takes, on the JobSet and on the node it acts on (``kubectl describe``
shows them). An Event's name is derived from the step's request id and the object, so telling a step again (a
controller that restarted) creates nothing new: the API answers 409 and the first Event stays. The Events are
also the cluster's record of what opsd did, request by request (the contract suite counts them).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

from opsd.backends.kubernetes.api import Json, KubeApi
from opsd.backends.kubernetes.cluster import JOBSET_GROUP, JOBSET_VERSION
from opsd.backends.kubernetes.nodes import rfc3339
from opsd.errors import OpsError

log = logging.getLogger(__name__)

COMPONENT = "opsd-controller"
REQUEST_ANNOTATION = "opsd.io/request-id"
NODE_EVENTS_NAMESPACE = "default"  # a cluster-scoped object's Events live there, as kubectl's own


@dataclass(frozen=True)
class Target:
    kind: str  # Node or JobSet
    name: str
    namespace: str = ""  # "" for a node
    uid: str = ""

    @property
    def api_version(self) -> str:
        return "v1" if self.kind == "Node" else f"{JOBSET_GROUP}/{JOBSET_VERSION}"


def event_name(request_id: str, target: Target) -> str:
    digest = hashlib.sha256(f"{request_id}/{target.kind}/{target.namespace}/{target.name}".encode()).hexdigest()
    return f"opsd.{digest[:20]}"


def event_body(
    target: Target,
    reason: str,
    message: str,
    request_id: str,
    now_s: float,
    *,
    warning: bool,
    annotations: dict[str, str] | None = None,
) -> Json:
    namespace = target.namespace or NODE_EVENTS_NAMESPACE
    involved: Json = {"kind": target.kind, "name": target.name, "apiVersion": target.api_version}
    if target.namespace:
        involved["namespace"] = target.namespace
    if target.uid:
        involved["uid"] = target.uid
    stamp = rfc3339(now_s)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": event_name(request_id, target),
            "namespace": namespace,
            "annotations": {REQUEST_ANNOTATION: request_id, **(annotations or {})},
        },
        "involvedObject": involved,
        "reason": reason,
        "message": message[:1024],
        "type": "Warning" if warning else "Normal",
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": COMPONENT,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


def tell(
    api: KubeApi,
    targets: list[Target],
    reason: str,
    message: str,
    request_id: str,
    now_s: float,
    *,
    warning: bool = False,
    annotations: dict[str, str] | None = None,
) -> None:
    """One Event per target; a failure to record one is logged, never fatal (the step is done)."""
    for target in targets:
        body = event_body(target, reason, message, request_id, now_s, warning=warning, annotations=annotations)
        try:
            api.create_event(body["metadata"]["namespace"], body)
        except OpsError as exc:
            log.warning("event %s on %s %s not recorded: %s", reason, target.kind, target.name, exc)


def recorded(api: KubeApi, target: Target, request_id: str) -> Json | None:
    """The Event a step recorded on ``target`` for ``request_id``, if any (what a step must remember across a
    controller's restart: the restart attempt a stop evicted)."""
    try:
        return api.event(target.namespace or NODE_EVENTS_NAMESPACE, event_name(request_id, target))
    except OpsError:
        return None
