"""What opsd does to nodes: quarantine a failed one, release it, promote a spare (docs/kubernetes.md).

Each change is a read-modify-write of the whole node with its ``resourceVersion`` (``KubeApi.replace_node``):
``spec.taints`` has no merge key, so a patch would replace the list whole and drop a taint someone else set
meanwhile. A ``ConflictError`` (the node changed since it was read) is answered by reading it again, up to
``ATTEMPTS`` times. A change that finds the node as it should be writes nothing: each is idempotent, and what
another tool did already (a cordon by NVIDIA NVSentinel, say) is left as it is and not undone on release.
"""

from __future__ import annotations

import copy
import datetime
import logging
from collections.abc import Callable
from typing import Any

from opsd.backends.kubernetes.api import ConflictError, Json, KubeApi
from opsd.backends.kubernetes.cluster import (
    CORDONED_BY_OPSD_ANNOTATION,
    INCIDENT_ANNOTATION,
    POOL_LABEL,
    QUARANTINE_TAINT,
    QUARANTINED_AT_ANNOTATION,
    REASON_ANNOTATION,
    RUN_LABEL,
    SPARE_POOL,
    SPARE_TAINT,
    STATE_LABEL,
)
from opsd.errors import TransientError

log = logging.getLogger(__name__)

ATTEMPTS = 5
NO_SCHEDULE = "NoSchedule"


def rfc3339(unix_s: float) -> str:
    return datetime.datetime.fromtimestamp(unix_s, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(text: str) -> float | None:
    try:
        return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC).timestamp()
    except (TypeError, ValueError):
        return None


def taint_value(text: str) -> str:
    """A taint's value from free text: letters, digits, ``-``, ``_`` and ``.``, at most 63 characters."""
    kept = "".join(c if c.isalnum() or c in "-_." else "-" for c in text)[:63].strip("-_.")
    return kept or "failure"


def edit_node(api: KubeApi, name: str, change: Callable[[Json], None]) -> bool:
    """Read the node, apply ``change`` to a copy, write it back unless nothing changed; again on a conflict.
    Whether it wrote."""
    for attempt in range(1, ATTEMPTS + 1):
        node = api.node(name)
        edited = copy.deepcopy(node)
        change(edited)
        if edited == node:
            return False
        try:
            api.replace_node(edited)
            return True
        except ConflictError:
            log.info("node %s changed while it was edited (attempt %d): reading it again", name, attempt)
    raise TransientError(f"node {name} kept changing: {ATTEMPTS} conflicting writes", retry_after_s=1.0)


def _taints(node: Json) -> list[dict[str, Any]]:
    spec = node.setdefault("spec", {})
    taints: list[dict[str, Any]] = spec.setdefault("taints", []) or []
    spec["taints"] = taints
    return taints


def _meta(node: Json, key: str) -> dict[str, str]:
    section: dict[str, str] = node.setdefault("metadata", {}).setdefault(key, {}) or {}
    node["metadata"][key] = section
    return section


def has_taint(node: Json, key: str) -> bool:
    return any(t.get("key") == key for t in (node.get("spec") or {}).get("taints") or [])


def quarantine(api: KubeApi, name: str, *, cause: str, reason: str, incident: str, now_s: float) -> bool:
    """Take a node out of service: unschedulable, the quarantine taint, the quarantined state label and the
    incident's annotations. Whether it changed the node."""

    def change(node: Json) -> None:
        spec = node.setdefault("spec", {})
        annotations, labels = _meta(node, "annotations"), _meta(node, "labels")
        if not spec.get("unschedulable"):
            spec["unschedulable"] = True
            annotations[CORDONED_BY_OPSD_ANNOTATION] = "true"  # only then may a release undo it
        if not has_taint(node, QUARANTINE_TAINT):
            _taints(node).append({"key": QUARANTINE_TAINT, "value": taint_value(cause), "effect": NO_SCHEDULE})
            annotations[QUARANTINED_AT_ANNOTATION] = rfc3339(now_s)
            annotations[INCIDENT_ANNOTATION] = incident
            annotations[REASON_ANNOTATION] = reason[:1000]
        labels[STATE_LABEL] = "quarantined"
        if labels.get(RUN_LABEL):
            del labels[RUN_LABEL]  # the run's pods no longer select it

    return edit_node(api, name, change)


def release(api: KubeApi, name: str) -> bool:
    """Put a quarantined node back in the spare pool: opsd's quarantine taint off, uncordoned when opsd cordoned it,
    labelled and tainted as a spare. Whether it changed the node."""

    def change(node: Json) -> None:
        annotations, labels = _meta(node, "annotations"), _meta(node, "labels")
        node["spec"]["taints"] = [t for t in _taints(node) if t.get("key") != QUARANTINE_TAINT]
        if annotations.pop(CORDONED_BY_OPSD_ANNOTATION, None) == "true":
            node["spec"]["unschedulable"] = False
        for key in (QUARANTINED_AT_ANNOTATION, INCIDENT_ANNOTATION, REASON_ANNOTATION):
            annotations.pop(key, None)
        labels.pop(RUN_LABEL, None)
        labels[POOL_LABEL], labels[STATE_LABEL] = SPARE_POOL, "spare"
        if not has_taint(node, SPARE_TAINT):
            _taints(node).append({"key": SPARE_TAINT, "value": "true", "effect": NO_SCHEDULE})

    return edit_node(api, name, change)


def promote(api: KubeApi, name: str, run: str) -> bool:
    """Make a spare one of the run's nodes: its spare taint and pool label off, the run's label on (the run's pods
    select their nodes by it). Whether it changed the node."""

    def change(node: Json) -> None:
        labels = _meta(node, "labels")
        node["spec"]["taints"] = [t for t in _taints(node) if t.get("key") != SPARE_TAINT]
        if labels.get(POOL_LABEL) == SPARE_POOL:
            del labels[POOL_LABEL]
        labels[RUN_LABEL], labels[STATE_LABEL] = run, "active"

    return edit_node(api, name, change)


def mark_active(api: KubeApi, name: str, run: str) -> bool:
    """Label a node a run's pods landed on as the run's (``opsd.io/run=<run>``, state ``active``): the run's restarted
    pods prefer it (docs/kubernetes.md), and nobody labels nodes by hand. Nothing on a quarantined node or a spare.
    Whether it changed the node."""

    def change(node: Json) -> None:
        labels = _meta(node, "labels")
        if has_taint(node, QUARANTINE_TAINT) or labels.get(POOL_LABEL) == SPARE_POOL:
            return
        labels[RUN_LABEL], labels[STATE_LABEL] = run, "active"

    return edit_node(api, name, change)


def quarantined_since(nodes: list[Json], since_s: float) -> list[str]:
    """The nodes opsd quarantined at or after ``since_s`` (from their annotations: a controller's restart does not
    forget them)."""
    out = []
    for node in nodes:
        at = parse_rfc3339(((node.get("metadata") or {}).get("annotations") or {}).get(QUARANTINED_AT_ANNOTATION, ""))
        if at is not None and at >= since_s and has_taint(node, QUARANTINE_TAINT):
            out.append(node["metadata"]["name"])
    return sorted(out)


def unusable(node: Json) -> bool:
    """Whether no pod of a run may be placed there: unschedulable, quarantined, or a spare not promoted."""
    return bool((node.get("spec") or {}).get("unschedulable")) or has_taint(node, QUARANTINE_TAINT)


def ready(node: Json) -> bool:
    """Whether the kubelet says the node is up: its ``Ready`` condition is ``True`` (``False`` or ``Unknown``: the
    kubelet reports it down, or has stopped reporting)."""
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
