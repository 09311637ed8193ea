"""The emulated API server's storage: objects by resource, namespace and name, one global resourceVersion
counter (etcd's revision), the history of changes that watches replay, and the registry rules applied on every
create, update, patch and delete (see ``tests.kube.emulator`` for the list of behaviours).

Everything here runs on the server's event loop thread: no locks. Watchers receive each change on an
``asyncio.Queue`` as it is committed. Objects are stored and returned as plain JSON dicts; every read returns a
copy.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import logging
import random
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tests.kube import errors
from tests.kube.patches import apply_patch
from tests.kube.resources import ResourceType, resource_named, resource_of
from tests.kube.selectors import Selector

logger = logging.getLogger(__name__)

ObjectKey = tuple[str, str, str]  # resource name (``pods``, ``leases.coordination.k8s.io``), namespace or "", name
Json = dict[str, Any]

# Fields of metadata that only the server sets; a write's body cannot change them.
SERVER_OWNED_METADATA = (
    "name",
    "namespace",
    "uid",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
    "resourceVersion",
)
_NAME_SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # k8s.io/apimachinery/pkg/util/rand


@dataclass(frozen=True)
class WatchEvent:
    """One committed change: the object after it (for DELETED the last state, carrying the deletion's
    resourceVersion) and the object before it (None for ADDED)."""

    resource_version: int
    type: str  # "ADDED", "MODIFIED" or "DELETED"
    rtype: ResourceType
    obj: Json
    previous: Json | None


def rfc3339(at: datetime.datetime | None = None) -> str:
    """A timestamp as the API writes metadata times: UTC, whole seconds, ``Z``."""
    return (at or datetime.datetime.now(datetime.UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")


def _spec_of(obj: Mapping[str, Any]) -> Json:
    """What a generation counts: everything but metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}


def _metadata(obj: Mapping[str, Any]) -> Json:
    meta = obj.get("metadata")
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise errors.bad_request("metadata must be an object")
    return meta


class ObjectStore:
    """Objects, their resourceVersions and the change history of the emulated server."""

    def __init__(self, history_limit: int = 1000) -> None:
        if history_limit < 1:
            raise ValueError("history_limit must be >= 1")
        self._objects: dict[ObjectKey, Json] = {}
        self._rv = 0
        self._history: deque[WatchEvent] = deque()
        self._history_limit = history_limit
        self._compacted_rv = 0  # the events up to this resourceVersion are no longer replayable
        self._subscribers: dict[asyncio.Queue[WatchEvent], str] = {}
        # pods whose kubelet never confirms a graceful deletion: (namespace, name)
        self.stuck_terminating: set[tuple[str, str]] = set()

    @property
    def resource_version(self) -> int:
        return self._rv

    # --- reads ---------------------------------------------------------------------------------------------

    def _key(self, rtype: ResourceType, namespace: str, name: str) -> ObjectKey:
        return (rtype.name, namespace if rtype.namespaced else "", name)

    def find(self, rtype: ResourceType, namespace: str, name: str) -> Json | None:
        obj = self._objects.get(self._key(rtype, namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def read(self, rtype: ResourceType, namespace: str, name: str) -> Json:
        obj = self.find(rtype, namespace, name)
        if obj is None:
            raise errors.not_found(rtype, name)
        return obj

    def last_state(self, rtype: ResourceType, namespace: str, name: str) -> Json | None:
        """The object as the newest retained change left it (for a deleted one, its last state, as a watch's DELETED
        event carries it); None when no retained change is of it."""
        key = self._key(rtype, namespace, name)
        for event in reversed(self._history):
            meta = event.obj.get("metadata") or {}
            if self._key(event.rtype, meta.get("namespace", ""), meta.get("name", "")) == key:
                return copy.deepcopy(event.obj)
        return None

    def select(self, rtype: ResourceType, namespace: str | None, selector: Selector | None = None) -> list[Json]:
        """The objects of a resource (in one namespace, or all), sorted by namespace and name as etcd keys are."""
        items = [
            obj
            for (res, ns, _), obj in sorted(self._objects.items())
            if res == rtype.name and (not namespace or ns == namespace) and (selector is None or selector.matches(obj))
        ]
        return copy.deepcopy(items)

    # --- watch ---------------------------------------------------------------------------------------------

    def subscribe(
        self, rtype: ResourceType, since_rv: int | None
    ) -> tuple[list[WatchEvent], asyncio.Queue[WatchEvent]]:
        """The events a new watch starts with and the queue that receives every later change of ``rtype``.

        ``since_rv`` None: an ADDED event for each current object (a watch without resourceVersion, or "0");
        else the retained events after it, or 410 Expired when some of them were compacted away."""
        if since_rv is None:
            replay = [
                WatchEvent(int(obj["metadata"]["resourceVersion"]), "ADDED", rtype, copy.deepcopy(obj), None)
                for obj in self.select(rtype, None)
            ]
        elif since_rv < self._compacted_rv:
            raise errors.expired(since_rv, self._compacted_rv)
        elif since_rv > self._rv:
            raise errors.too_large_resource_version(since_rv, self._rv)
        else:
            replay = [e for e in self._history if e.rtype.name == rtype.name and e.resource_version > since_rv]
        queue: asyncio.Queue[WatchEvent] = asyncio.Queue()
        self._subscribers[queue] = rtype.name
        return replay, queue

    def unsubscribe(self, queue: asyncio.Queue[WatchEvent]) -> None:
        self._subscribers.pop(queue, None)

    def compact(self) -> None:
        """Forget the change history up to now, as etcd compaction does: a watch from an older resourceVersion
        gets 410 Expired."""
        self._history.clear()
        self._compacted_rv = self._rv

    # --- commits -------------------------------------------------------------------------------------------

    def _commit(self, kind: str, key: ObjectKey, obj: Json, previous: Json | None) -> Json:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        if kind == "DELETED":
            self._objects.pop(key, None)
        else:
            self._objects[key] = obj
        event = WatchEvent(self._rv, kind, resource_named(key[0]), copy.deepcopy(obj), previous)
        self._history.append(event)
        while len(self._history) > self._history_limit:
            self._compacted_rv = self._history.popleft().resource_version
        for queue, name in self._subscribers.items():
            if name == key[0]:
                queue.put_nowait(event)
        logger.debug("%s %s/%s/%s at resourceVersion %d", kind, *key, self._rv)
        return copy.deepcopy(obj)

    def _held(self, rtype: ResourceType, obj: Mapping[str, Any]) -> bool:
        """Whether an object marked for deletion must stay: finalizers left, or a pod whose kubelet is stuck."""
        meta = obj["metadata"]
        stuck = (meta.get("namespace", ""), meta["name"]) in self.stuck_terminating and rtype.name == "pods"
        return bool(meta.get("finalizers")) or (stuck and meta.get("deletionGracePeriodSeconds", 0) > 0)

    def _namespace_exists(self, namespace: str) -> bool:
        return ("namespaces", "", namespace) in self._objects

    # --- writes through the API ----------------------------------------------------------------------------

    def create(self, rtype: ResourceType, namespace: str, body: Any) -> Json:
        """POST: a new object; 409 AlreadyExists if the name is taken, 404 if its namespace does not exist."""
        if not isinstance(body, dict):
            raise errors.bad_request("the body of a create must be a JSON object")
        obj = copy.deepcopy(body)
        meta = _metadata(obj)
        obj["metadata"] = meta
        if meta.get("resourceVersion"):
            raise errors.internal("resourceVersion should not be set on objects to be created")
        if rtype.namespaced:
            if meta.get("namespace") and meta["namespace"] != namespace:
                raise errors.bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise errors.invalid(rtype, "", "metadata.name", "Required value: name or generateName is required")
            meta["name"] = meta["generateName"] + "".join(random.choices(_NAME_SUFFIX_ALPHABET, k=5))
        if rtype.namespaced and not self._namespace_exists(namespace):
            raise errors.namespace_not_found(namespace)
        key = self._key(rtype, namespace, meta["name"])
        if key in self._objects:
            raise errors.already_exists(rtype, meta["name"])
        if rtype.status_on_create == "drop":
            obj.pop("status", None)
        elif isinstance(rtype.status_on_create, Mapping):
            obj["status"] = copy.deepcopy(dict(rtype.status_on_create))
        for field in ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "generation"):
            meta.pop(field, None)
        obj["apiVersion"], obj["kind"] = rtype.api_version, rtype.kind
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = rfc3339()
        if rtype.tracks_generation:
            meta["generation"] = 1
        return self._commit("ADDED", key, obj, None)

    def _check_identity(self, rtype: ResourceType, namespace: str, name: str, obj: Mapping[str, Any]) -> None:
        meta = _metadata(obj)
        if meta.get("name") and meta["name"] != name:
            raise errors.bad_request(
                f"the name of the object ({meta['name']}) does not match the name on the URL ({name})"
            )
        if rtype.namespaced and meta.get("namespace") and meta["namespace"] != namespace:
            raise errors.bad_request(
                "the namespace of the provided object does not match the namespace sent on the request"
            )

    def _prepare_update(self, rtype: ResourceType, current: Json, body: Json, subresource: str | None) -> Json:
        """The object an update would store: the resourceVersion precondition checked, server-owned metadata
        kept, the status split honoured, the generation counted."""
        body_meta = _metadata(body)
        name = current["metadata"]["name"]
        body_rv = body_meta.get("resourceVersion") or ""
        if body_rv:
            if body_rv != current["metadata"]["resourceVersion"]:
                raise errors.stale_conflict(rtype, name)
        elif not rtype.unconditional_update:
            raise errors.invalid(
                rtype, name, "metadata.resourceVersion", "Invalid value: 0x0: must be specified for an update"
            )
        if subresource == "status":
            result = copy.deepcopy(current)
            if "status" in body:
                result["status"] = copy.deepcopy(body["status"])
            else:
                result.pop("status", None)
        else:
            result = copy.deepcopy(body)
            result["metadata"] = copy.deepcopy(body_meta)
            if rtype.status_subresource:
                result.pop("status", None)
                if "status" in current:
                    result["status"] = copy.deepcopy(current["status"])
        meta = result["metadata"]
        for field in SERVER_OWNED_METADATA:
            meta.pop(field, None)
            if field in current["metadata"]:
                meta[field] = current["metadata"][field]
        result["apiVersion"], result["kind"] = rtype.api_version, rtype.kind
        if rtype.tracks_generation and _spec_of(result) != _spec_of(current):
            meta["generation"] = int(current["metadata"].get("generation", 1)) + 1
        return result

    def _store_update(self, rtype: ResourceType, key: ObjectKey, current: Json, new: Json) -> Json:
        if new == current:
            return copy.deepcopy(current)  # a no-op write: etcd keeps the revision and nothing is sent to watches
        obj = self._commit("MODIFIED", key, new, copy.deepcopy(current))
        if new["metadata"].get("deletionTimestamp") and not self._held(rtype, new):
            return self._commit("DELETED", key, new, obj)  # its last finalizer was removed
        return obj

    def replace(
        self, rtype: ResourceType, namespace: str, name: str, body: Any, subresource: str | None = None
    ) -> tuple[Json, bool]:
        """PUT: the object replaced (409 on a stale resourceVersion); created when the kind allows it."""
        if not isinstance(body, dict):
            raise errors.bad_request("the body of an update must be a JSON object")
        self._check_identity(rtype, namespace, name, body)
        key = self._key(rtype, namespace, name)
        current = self._objects.get(key)
        if current is None:
            if not (rtype.create_on_update and subresource is None):
                raise errors.not_found(rtype, name)
            body = copy.deepcopy(body)
            meta = _metadata(body)
            body["metadata"] = meta
            meta["name"] = name
            meta.pop("resourceVersion", None)
            return self.create(rtype, namespace, body), True
        new = self._prepare_update(rtype, current, body, subresource)
        return self._store_update(rtype, key, current, new), False

    def patch(
        self,
        rtype: ResourceType,
        namespace: str,
        name: str,
        content_type: str,
        patch: Any,
        subresource: str | None = None,
    ) -> Json:
        """PATCH: the patch applied to the stored object, then stored as an update (409 if the patched object
        carries a resourceVersion other than the stored one)."""
        key = self._key(rtype, namespace, name)
        current = self._objects.get(key)
        if current is None:
            raise errors.not_found(rtype, name)
        patched = apply_patch(current, content_type, patch, custom=rtype.custom)
        self._check_identity(rtype, namespace, name, patched)
        new = self._prepare_update(rtype, current, patched, subresource)
        return self._store_update(rtype, key, current, new)

    def _grace_period_s(self, rtype: ResourceType, obj: Mapping[str, Any], requested_s: int | None) -> int:
        """How long a deletion waits: only a pod bound to a node and not finished waits (for its kubelet)."""
        if rtype.name != "pods":
            return 0
        spec, status = obj.get("spec") or {}, obj.get("status") or {}
        if not spec.get("nodeName") or status.get("phase") in ("Succeeded", "Failed"):
            return 0
        if requested_s is not None:
            return max(requested_s, 0)
        return int(spec.get("terminationGracePeriodSeconds", 30))

    def delete(
        self,
        rtype: ResourceType,
        namespace: str,
        name: str,
        grace_period_s: int | None = None,
        preconditions: Mapping[str, Any] | None = None,
    ) -> tuple[Json, bool]:
        """DELETE: the object's last state and whether it is gone (else it is marked with a deletionTimestamp
        and stays: finalizers, or a stuck pod)."""
        key = self._key(rtype, namespace, name)
        current = self._objects.get(key)
        if current is None:
            raise errors.not_found(rtype, name)
        meta = current["metadata"]
        for field, label in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
            wanted, actual = (preconditions or {}).get(field), meta.get(field)
            if wanted and wanted != actual:
                why = f"Precondition failed: {label} in precondition: {wanted}, {label} in object meta: {actual}"
                raise errors.conflict(rtype, name, why)
        grace_s = self._grace_period_s(rtype, current, grace_period_s)
        if meta.get("deletionTimestamp"):
            if grace_s == 0 and not meta.get("finalizers"):
                return self._commit("DELETED", key, copy.deepcopy(current), copy.deepcopy(current)), True
            return copy.deepcopy(current), False
        if grace_s == 0 and not meta.get("finalizers"):
            return self._commit("DELETED", key, copy.deepcopy(current), copy.deepcopy(current)), True
        marked = copy.deepcopy(current)
        at = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=grace_s)
        marked["metadata"]["deletionTimestamp"] = rfc3339(at)
        marked["metadata"]["deletionGracePeriodSeconds"] = grace_s
        if marked["metadata"].get("generation", 0) > 0:
            marked["metadata"]["generation"] += 1
        obj = self._commit("MODIFIED", key, marked, copy.deepcopy(current))
        if self._held(rtype, marked):
            return obj, False
        # a pod on a node: its kubelet stops the containers at once and confirms the deletion
        return self._commit("DELETED", key, marked, obj), True

    def modify(self, rtype: ResourceType, namespace: str, name: str, change: Callable[[Json], None]) -> Json:
        """A write by the server itself (e.g. the eviction's status condition): ``change`` edits a copy in place;
        no precondition, no status split; nothing is written if nothing changed."""
        key = self._key(rtype, namespace, name)
        current = self._objects.get(key)
        if current is None:
            raise errors.not_found(rtype, name)
        new = copy.deepcopy(current)
        change(new)
        return self._store_update(rtype, key, current, new)

    # --- writes by the test's hand -------------------------------------------------------------------------

    def put(self, obj: Mapping[str, Any]) -> Json:
        """Create or replace an object as the rest of a cluster would (a kubelet, a controller): no admission,
        no precondition, no status split. Server-owned metadata is stamped: uid and creationTimestamp (kept
        from the stored object or the given one), generation, a new resourceVersion."""
        rtype = resource_of(obj)
        new = copy.deepcopy(dict(obj))
        meta = _metadata(new)
        new["metadata"] = meta
        if not meta.get("name"):
            raise ValueError("put() needs metadata.name")
        if rtype.namespaced and not meta.get("namespace"):
            raise ValueError(f"put() needs metadata.namespace for {rtype.name}")
        key = self._key(rtype, meta.get("namespace", ""), meta["name"])
        current = self._objects.get(key)
        old_meta = current["metadata"] if current else {}
        meta["uid"] = old_meta.get("uid") or meta.get("uid") or str(uuid.uuid4())
        meta["creationTimestamp"] = old_meta.get("creationTimestamp") or meta.get("creationTimestamp") or rfc3339()
        meta["resourceVersion"] = old_meta.get("resourceVersion", "")
        if rtype.tracks_generation:
            if current is None:
                meta["generation"] = int(meta.get("generation", 1))
            elif _spec_of(new) != _spec_of(current):
                meta["generation"] = int(old_meta.get("generation", 1)) + 1
            else:
                meta["generation"] = old_meta.get("generation", 1)
        if current is None:
            return self._commit("ADDED", key, new, None)
        return self._store_update(rtype, key, current, new)

    def remove(self, rtype: ResourceType, namespace: str, name: str) -> Json | None:
        """Delete an object at once, whatever holds it (finalizers, a stuck kubelet); None if absent."""
        key = self._key(rtype, namespace, name)
        current = self._objects.get(key)
        if current is None:
            return None
        return self._commit("DELETED", key, copy.deepcopy(current), copy.deepcopy(current))

    def seed_namespaces(self, names: tuple[str, ...]) -> None:
        for name in names:
            if not self._namespace_exists(name):
                self.create(resource_named("namespaces"), "", {"metadata": {"name": name}})
