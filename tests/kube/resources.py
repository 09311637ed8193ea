"""The resource types the emulated API server serves, each with the registry behaviours of the real server that
the emulator reproduces (which writes keep the stored status, which kinds count generations, which allow an
update without a resourceVersion, which answer a DELETE with the deleted object).

The flags come from the upstream registries (kubernetes/kubernetes ``pkg/registry/*/strategy.go`` and
``storage.go``; apiextensions-apiserver for custom resources): e.g. a Lease has no status subresource, allows
create-on-update and forbids unconditional updates; a Pod's main resource ignores ``status``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

# What a create through the API does with the body's ``status``: keep it (a kubelet creates its Node with one),
# drop it, or replace it with a fixed initial status (a Pod starts Pending, a Namespace Active).
StatusOnCreate = Literal["keep", "drop"] | Mapping[str, Any]


@dataclass(frozen=True)
class ResourceType:
    """One served resource (``group/version/plural``) and how its registry behaves."""

    group: str  # "" for the core group
    version: str
    plural: str
    kind: str
    namespaced: bool
    # writes to the main resource keep the stored .status; .status is written through <plural>/status
    status_subresource: bool
    # metadata.generation starts at 1 and grows when anything outside metadata and status changes
    tracks_generation: bool
    # a PUT or PATCH whose body carries no metadata.resourceVersion is accepted (else 422)
    unconditional_update: bool
    # a PUT of a missing object creates it (else 404)
    create_on_update: bool
    # a DELETE that removes the object answers with the object (else with a Status)
    returns_deleted_object: bool
    # a CustomResourceDefinition's resource: no strategic merge patch (415), items keep kind/apiVersion in lists
    custom: bool = False
    status_on_create: StatusOnCreate = field(default="keep", compare=False)  # a dict is unhashable
    # fieldSelector keys beyond metadata.name and metadata.namespace, each a dotted path into the object
    field_labels: frozenset[str] = field(default_factory=frozenset)
    subresources: tuple[str, ...] = ()
    singular: str = ""
    short_names: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def name(self) -> str:
        """The name kubectl uses: ``pods``, ``leases.coordination.k8s.io``."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def list_kind(self) -> str:
        return f"{self.kind}List"


CORE_EVENT_FIELDS = frozenset(
    {
        "involvedObject.kind",
        "involvedObject.namespace",
        "involvedObject.name",
        "involvedObject.uid",
        "reason",
        "type",
    }
)

RESOURCE_TYPES: tuple[ResourceType, ...] = (
    ResourceType(
        group="",
        version="v1",
        plural="namespaces",
        kind="Namespace",
        namespaced=False,
        status_subresource=True,
        tracks_generation=False,
        unconditional_update=True,
        create_on_update=False,
        returns_deleted_object=True,
        status_on_create={"phase": "Active"},
        field_labels=frozenset({"status.phase"}),
        subresources=("status",),
        short_names=("ns",),
    ),
    ResourceType(
        group="",
        version="v1",
        plural="nodes",
        kind="Node",
        namespaced=False,
        status_subresource=True,
        tracks_generation=False,
        unconditional_update=True,
        create_on_update=False,
        returns_deleted_object=False,
        status_on_create="keep",
        field_labels=frozenset({"spec.unschedulable"}),
        subresources=("status",),
        short_names=("no",),
    ),
    ResourceType(
        group="",
        version="v1",
        plural="pods",
        kind="Pod",
        namespaced=True,
        status_subresource=True,
        tracks_generation=True,
        unconditional_update=True,
        create_on_update=False,
        returns_deleted_object=True,
        status_on_create={"phase": "Pending"},
        field_labels=frozenset({"spec.nodeName", "status.phase"}),
        subresources=("status", "eviction"),
        short_names=("po",),
    ),
    ResourceType(
        group="",
        version="v1",
        plural="secrets",
        kind="Secret",
        namespaced=True,
        status_subresource=False,
        tracks_generation=False,
        unconditional_update=True,
        create_on_update=False,
        returns_deleted_object=False,
    ),
    ResourceType(
        group="",
        version="v1",
        plural="events",
        kind="Event",
        namespaced=True,
        status_subresource=False,
        tracks_generation=False,
        unconditional_update=True,
        create_on_update=False,
        returns_deleted_object=False,
        field_labels=CORE_EVENT_FIELDS,
        short_names=("ev",),
    ),
    ResourceType(
        group="events.k8s.io",
        version="v1",
        plural="events",
        kind="Event",
        namespaced=True,
        status_subresource=False,
        tracks_generation=False,
        unconditional_update=True,
        create_on_update=False,
        returns_deleted_object=False,
        short_names=("ev",),
    ),
    ResourceType(
        group="coordination.k8s.io",
        version="v1",
        plural="leases",
        kind="Lease",
        namespaced=True,
        status_subresource=False,
        tracks_generation=False,
        unconditional_update=False,
        create_on_update=True,
        returns_deleted_object=False,
    ),
    ResourceType(
        group="apps",
        version="v1",
        plural="daemonsets",
        kind="DaemonSet",
        namespaced=True,
        status_subresource=True,
        tracks_generation=True,
        unconditional_update=True,
        create_on_update=False,
        returns_deleted_object=False,
        status_on_create={},
        subresources=("status",),
        short_names=("ds",),
    ),
    ResourceType(
        group="batch",
        version="v1",
        plural="jobs",
        kind="Job",
        namespaced=True,
        status_subresource=True,
        tracks_generation=True,
        unconditional_update=True,
        create_on_update=False,
        returns_deleted_object=False,
        status_on_create={},
        subresources=("status",),
    ),
    ResourceType(
        group="jobset.x-k8s.io",
        version="v1alpha2",
        plural="jobsets",
        kind="JobSet",
        namespaced=True,
        status_subresource=True,
        tracks_generation=True,
        unconditional_update=False,
        create_on_update=False,
        returns_deleted_object=True,
        custom=True,
        status_on_create="drop",
        subresources=("status",),
    ),
)


def find_resource(group: str, version: str, plural: str) -> ResourceType | None:
    """The served resource at ``/api(s)/<group>/<version>/<plural>``, or None."""
    for rtype in RESOURCE_TYPES:
        if (rtype.group, rtype.version, rtype.plural) == (group, version, plural):
            return rtype
    return None


def resource_named(name: str) -> ResourceType:
    """The resource by its kubectl name (``pods``, ``events.events.k8s.io``, ``jobsets.jobset.x-k8s.io``) or,
    where that is unambiguous, by plural alone (``leases``, ``jobsets``, ``jobs``)."""
    exact = [r for r in RESOURCE_TYPES if r.name == name]
    if exact:
        return exact[0]
    by_plural = [r for r in RESOURCE_TYPES if r.plural == name]
    if len(by_plural) == 1:
        return by_plural[0]
    raise KeyError(f"no served resource named {name!r}")


def resource_of(obj: Mapping[str, Any]) -> ResourceType:
    """The resource an object belongs to, from its ``apiVersion`` and ``kind``."""
    api_version, kind = obj.get("apiVersion"), obj.get("kind")
    for rtype in RESOURCE_TYPES:
        if (rtype.api_version, rtype.kind) == (api_version, kind):
            return rtype
    raise KeyError(f"no served resource for apiVersion={api_version!r} kind={kind!r}")
