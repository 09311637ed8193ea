"""An emulated Kubernetes API server on loopback for tests: real HTTP, spoken to by the official ``kubernetes``
client, served from memory by an aiohttp server on its own event loop in a background thread.

    with kube_emulator() as kube:
        core = kubernetes.client.CoreV1Api(kube.api_client)
        kube.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})
        core.patch_node("n1", {"spec": {"unschedulable": True}})
        assert kube.get("nodes", None, "n1")["spec"]["unschedulable"]
        assert kube.count("PATCH", "/api/v1/nodes/n1") == 1

No real API server can run on this machine. Discovery (``/api``, ``/apis``, ``/apis/<group>[/<version>]``,
``/version``) is kmock's ``KubernetesScaffold`` (PyPI ``kmock``), corrected where the client could not read it;
kmock's own ``KubernetesEmulator`` is not used (it ignores selectors, stamps no resourceVersion, maps no PUT,
merges every PATCH as a plain dict merge, has no watch history, and its URL parser fails on
``/api/v1/namespaces``). Everything below is this package's (``store``, ``patches``, ``selectors``, ``api``).

What it reproduces, on the calls the project makes:

Resources. Core v1 ``namespaces``, ``nodes`` (cluster-scoped), ``pods``, ``secrets``, ``events``;
``coordination.k8s.io/v1`` ``leases``; ``events.k8s.io/v1`` ``events`` (stored apart from core events: the real
server shows one set of events through both APIs, converted); ``batch/v1`` ``jobs``; the JobSet CRD
``jobset.x-k8s.io/v1alpha2`` ``jobsets`` (namespaced, status subresource). Subresources: ``status`` (nodes, pods,
namespaces, jobs, jobsets) and ``pods/eviction``. Any other resource or subresource: 404 "the server could not find
the requested resource". A resource named in ``absent`` is not served at all (a cluster without its CRD: no
discovery entry, 404).
Namespaces ``default``, ``kube-system``, ``kube-public`` and ``kube-node-lease`` exist from the start.

Metadata. Every write takes the next value of one global counter as ``metadata.resourceVersion`` (a decimal
string, as etcd's revision); a delete takes one too, carried by the DELETED event. A create sets a new ``uid``
and ``creationTimestamp`` (UTC, whole seconds). ``generation`` is set to 1 on create and incremented when
anything outside metadata and status changes, and when a graceful deletion marks the object, for the kinds whose
registries count it (pods, jobs, jobsets; not nodes, namespaces, leases or events). A write that changes nothing
takes no resourceVersion and sends no watch event (as etcd). A write's body cannot change name, namespace, uid,
creationTimestamp, deletionTimestamp, generation.

Status split. For kinds with a status subresource a create replaces the body's ``status`` with the initial one
(pods: ``{"phase": "Pending"}`` only, no qosClass; namespaces: ``{"phase": "Active"}``; jobs: ``{}``) or drops it
(jobsets); nodes keep theirs. A PUT or PATCH of the main resource keeps the stored status; one of
``<plural>/status`` changes only ``status``.

Create (POST). 201 with the object; 409 AlreadyExists for a taken name; 404 when the namespace does not exist
(NamespaceLifecycle); ``generateName`` gets 5 random characters; neither name nor generateName: 422; a body with
a resourceVersion: 500 "resourceVersion should not be set on objects to be created" (the storage error).

Read and list (GET). 404 with a ``Status`` body (reason NotFound, ``pods "x" not found``) for a missing object.
A list carries ``metadata.resourceVersion`` (the current counter); items sorted by namespace and name, without
kind/apiVersion for built-in kinds (typed lists), with them for jobsets. ``labelSelector``: ``a=b``, ``a==b``,
``a!=b``, ``a``, ``!a``, ``a in (x,y)``, ``a notin (x,y)`` (``!=``/``notin`` also match objects without the
label); ``fieldSelector``: ``=``, ``==``, ``!=`` on ``metadata.name``, ``metadata.namespace`` and the fields
each kind indexes here (pods ``spec.nodeName``, ``status.phase``; nodes ``spec.unschedulable``; namespaces
``status.phase``; core events ``involvedObject.{kind,namespace,name,uid}``, ``reason``, ``type``); a missing
field reads as ``""``. A malformed selector or another field: 400. Not emulated: ``limit``/``continue`` (every
item comes in one page, as the server may answer), ``resourceVersion``/``resourceVersionMatch`` on lists (the
latest state is always served), tables, protobuf.

Watch (``?watch=true``, on a list path or, with a name, on one object). Without ``resourceVersion`` or with
"0": an ADDED event per current object, then every change. From resourceVersion N: the retained changes after N,
then every change. N older than the retained history (``history_limit`` changes, or everything before the last
``compact()``): HTTP 200 with one ERROR event carrying a 410 ``Status`` (reason Expired, "too old resource
version: N (M)"), as the watch cache answers; the client must list again. N newer than the counter: an ERROR
event with 504 (reason Timeout). Namespace, name, label and field selectors apply; a change that moves an object
into the selection arrives as ADDED, out of it as DELETED. ``allowWatchBookmarks=true``: a BOOKMARK event (kind,
apiVersion and ``metadata.resourceVersion`` only) every ``bookmark_interval_s`` while no change is pending (the
real server: about once a minute). ``timeoutSeconds``: the stream ends then (no timeout: it lasts until the
client leaves or the server stops). Not emulated: ``sendInitialEvents`` (501).

Replace (PUT). 200 with the object; 409 Conflict ("the object has been modified; please apply your changes to
the latest version and try again") when the body's resourceVersion is not the stored one; a body without one:
accepted for kinds that allow unconditional updates, 422 for leases and jobsets; name or namespace other than
the URL's: 400; a missing object: 404, except a Lease, which a PUT creates (201).

Patch (PATCH), by ``Content-Type``: ``application/merge-patch+json`` (RFC 7386: lists replaced);
``application/strategic-merge-patch+json`` for built-in kinds (415 for jobsets, as for every custom resource):
maps merged, ``null`` deletes, lists replaced whole unless listed in ``patches.MERGE_KEYS`` (``status.conditions``
and ``status.addresses`` by type, ``metadata.ownerReferences`` by uid, pod containers and volumes by name,
``metadata.finalizers`` as a set) -- so ``spec.taints``, which has no merge key, is REPLACED by a patch exactly as
by the real server; SMP directives (``$patch`` ...): 501; ``application/json-patch+json`` (RFC 6902; a failing
``test`` or a bad path: 422 Invalid); ``application/apply-patch+yaml`` (server-side apply): 501. A patched object
whose ``metadata.resourceVersion`` differs from the stored one (the patch set a stale one): 409. Missing: 404.
No managedFields are kept.

Delete (DELETE). ``gracePeriodSeconds`` from the DeleteOptions body when there is one, else the query;
``preconditions`` (uid, resourceVersion) give 409 when they do not hold. Only a pod bound to a node
(``spec.nodeName``) and not Succeeded/Failed waits for a grace period (its own ``terminationGracePeriodSeconds``,
else 30, unless given): the pod gets ``deletionTimestamp`` and ``deletionGracePeriodSeconds`` (MODIFIED), then,
since its kubelet is assumed to stop it at once, goes away (DELETED); every other object goes at once. An object
with ``metadata.finalizers`` stays, marked, until an update removes the last one. A pod marked with
``stick_terminating()`` stays marked ("Terminating") until a delete with ``gracePeriodSeconds=0``. Answers: an
object that stays, and a removed pod, namespace or jobset, come back as the object; the other kinds, once gone,
as a ``Status`` (Success).
Namespaces go at once and leave their objects (no namespace controller). Not emulated: deletecollection (501),
``propagationPolicy`` (no garbage collector: deleting a Job leaves its pods), ``dryRun`` (501).

Eviction (POST ``pods/<name>/eviction``, a policy/v1 Eviction): 400 if the Eviction's name is not the URL's; 404
for a missing pod; else the pod gets the condition ``DisruptionTarget`` (status True, reason
``EvictionByEvictionAPI``, message "Eviction API: evicting") by a status write, then is deleted as above with
the Eviction's ``deleteOptions``; answer 201 with a Success ``Status``. ``refuse_evictions(n)`` makes the next n
evictions of pods a PodDisruptionBudget guards (phase not Pending/Succeeded/Failed, no deletionTimestamp; no
phase counts as guarded) answer 429 TooManyRequests with the DisruptionBudget cause, changing nothing.

For the test: ``put``/``get``/``objects``/``remove`` act on the store directly (no HTTP); ``requests`` lists every
request received (method, path, query, Content-Type, body, and the bearer token presented: who sent it),
discovery included, logged before it is answered; ``client(token)`` is a client that presents a token.

Also not emulated: authentication and authorization (any request is served; the client needs no token),
admission webhooks, schema validation and defaulting (any JSON object is stored as given), no controllers at
all (no scheduler, kubelet, Job or JobSet controller: tests play them with ``put``/``remove``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import TracebackType
from typing import Any, TypeVar

import kmock
import kubernetes.client
from aiohttp import web

from tests.kube.api import ApiHandler, RecordedRequest
from tests.kube.resources import RESOURCE_TYPES, resource_named
from tests.kube.store import Json, ObjectStore

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
VERBS = ("create", "delete", "get", "list", "patch", "update", "watch")


class Discovery(kmock.KubernetesScaffold):
    """kmock's discovery endpoints for the served resources, with ``/api`` and ``/version`` answered in full
    (kmock's ``/api`` lacks ``serverAddressByClientCIDRs``, which the client's model requires, and its
    ``/version`` claims a k3s 1.26)."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for rtype in RESOURCE_TYPES:
            self.resources[kmock.resource(rtype.group, rtype.version, rtype.plural)] = kmock.ResourceInfo(
                kind=rtype.kind,
                namespaced=rtype.namespaced,
                singular=rtype.singular or rtype.kind.lower(),
                verbs=set(VERBS),
                shortnames=set(rtype.short_names),
                subresources=set(rtype.subresources),
            )

    async def _serve_api(self, request: kmock.Request) -> Json:
        host = request.url.host or "127.0.0.1"
        return {
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": f"{host}:{request.url.port}"}],
        }

    async def _serve_server_version(self, request: kmock.Request) -> Json:
        return {
            "major": "1",
            "minor": "34",
            "gitVersion": "v1.34.0+opsd-emulator",
            "gitCommit": "0000000000000000000000000000000000000000",
            "gitTreeState": "clean",
            "buildDate": "2026-01-01T00:00:00Z",
            "goVersion": "go1.24",
            "compiler": "gc",
            "platform": "linux/amd64",
        }


class KubeEmulator:
    """The emulated API server (see the module docstring), its client, and a handle for the test: seed and
    inspect objects, count requests, and inject the failures a real cluster shows."""

    def __init__(
        self,
        *,
        bookmark_interval_s: float = 1.0,
        history_limit: int = 1000,
        namespaces: tuple[str, ...] = DEFAULT_NAMESPACES,
        absent: tuple[str, ...] = (),
    ) -> None:
        """``absent``: resources (as kubectl names them, ``jobsets.jobset.x-k8s.io``) this cluster does not serve,
        as one without their CRD: discovery leaves them out and their paths answer 404."""
        if bookmark_interval_s <= 0:
            raise ValueError("bookmark_interval_s must be > 0")
        self._bookmark_interval_s = bookmark_interval_s
        self._history_limit = history_limit
        self._namespaces = namespaces
        self._absent = frozenset(resource_named(name).name for name in absent)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._handler: ApiHandler | None = None
        self._server: web.Server | None = None
        self._listener: asyncio.Server | None = None
        self._discovery: Discovery | None = None
        self._api_client: kubernetes.client.ApiClient | None = None
        self.url = ""

    # --- lifecycle -----------------------------------------------------------------------------------------

    def start(self) -> None:
        """Serve on ``127.0.0.1:<free port>`` from a background thread; returns once it accepts connections."""
        if self._thread is not None:
            raise RuntimeError("the emulator is already started")
        started: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, args=(started,), name="kube-emulator", daemon=True)
        self._thread.start()
        port = started.result(timeout=30)
        self.url = f"http://127.0.0.1:{port}"
        configuration = kubernetes.client.Configuration(host=self.url)
        self._api_client = kubernetes.client.ApiClient(configuration)
        logger.info("emulated Kubernetes API server at %s", self.url)

    def _run(self, started: concurrent.futures.Future[int]) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        try:
            port = self._loop.run_until_complete(self._open())
        except BaseException as exc:
            self._loop.close()
            started.set_exception(exc)
            return
        started.set_result(port)
        self._loop.run_forever()
        self._loop.run_until_complete(self._close())
        self._loop.close()

    async def _open(self) -> int:
        store = ObjectStore(history_limit=self._history_limit)
        store.seed_namespaces(self._namespaces)
        self._discovery = Discovery()
        for rtype in RESOURCE_TYPES:
            if rtype.name in self._absent:
                del self._discovery.resources[kmock.resource(rtype.group, rtype.version, rtype.plural)]
        await self._discovery.__aenter__()
        self._handler = ApiHandler(store, self._discovery, self._bookmark_interval_s, self._absent)
        # handler_cancellation: a watch ends when its client disconnects
        self._server = web.Server(self._handler, handler_cancellation=True)
        self._listener = await asyncio.get_running_loop().create_server(self._server, "127.0.0.1", 0)
        port: int = self._listener.sockets[0].getsockname()[1]
        return port

    async def _close(self) -> None:
        assert self._handler is not None
        assert self._server is not None
        assert self._listener is not None
        self._listener.close()
        for task in list(self._handler.streams):
            task.cancel()
        # an idle keep-alive connection (a client response never released) holds shutdown for the whole timeout
        await self._server.shutdown(timeout=0.1)
        await self._listener.wait_closed()
        if self._discovery is not None:
            await self._discovery.__aexit__(None, None, None)

    def stop(self) -> None:
        """Close the client and the server, ending open watches; waits for the thread."""
        if self._api_client is not None:
            self._api_client.close()
            self._api_client = None
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self._thread = None

    def __enter__(self) -> KubeEmulator:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the server's loop thread (where the store lives) and return its result."""
        if self._loop is None or self._thread is None:
            raise RuntimeError("the emulator is not started")

        async def run() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=30)

    @property
    def _api(self) -> ApiHandler:
        assert self._handler is not None, "the emulator is not started"
        return self._handler

    # --- the client ----------------------------------------------------------------------------------------

    @property
    def api_client(self) -> kubernetes.client.ApiClient:
        """An official client configured for this server (no authentication)."""
        if self._api_client is None:
            raise RuntimeError("the emulator is not started")
        return self._api_client

    def client(self, token: str) -> kubernetes.client.ApiClient:
        """A client of this server that presents ``token`` as its bearer token (nothing checks it: its requests are
        told apart in ``requests``, as a real server's authorization tells its ServiceAccount)."""
        configuration = kubernetes.client.Configuration(host=self.url)
        configuration.api_key = {"authorization": token}
        configuration.api_key_prefix = {"authorization": "Bearer"}
        return kubernetes.client.ApiClient(configuration)

    # --- objects, by the test's hand -----------------------------------------------------------------------

    def put(self, obj: Mapping[str, Any]) -> Json:
        """Create or replace an object as the rest of the cluster would (no admission, no precondition, no status
        split); returns it as stored, with a new resourceVersion. Watches see ADDED or MODIFIED."""
        return self._call(lambda: self._api.store.put(obj))

    def get(self, resource: str, namespace: str | None, name: str) -> Json | None:
        """The stored object (``resource`` as kubectl names it: ``pods``, ``leases``, ``events.events.k8s.io``),
        or None; ``namespace`` None for cluster-scoped kinds."""
        rtype = resource_named(resource)
        return self._call(lambda: self._api.store.find(rtype, namespace or "", name))

    def objects(self, resource: str, namespace: str | None = None) -> list[Json]:
        """The stored objects of a resource (in one namespace, or all), sorted by namespace and name."""
        rtype = resource_named(resource)
        return self._call(lambda: self._api.store.select(rtype, namespace))

    def last_state(self, resource: str, namespace: str | None, name: str) -> Json | None:
        """The object as its newest retained change left it, deleted or not (what a watcher saw last), or None."""
        rtype = resource_named(resource)
        return self._call(lambda: self._api.store.last_state(rtype, namespace or "", name))

    def remove(self, resource: str, namespace: str | None, name: str) -> Json | None:
        """Delete at once, whatever holds the object (finalizers, a stuck kubelet); its last state, or None."""
        rtype = resource_named(resource)
        return self._call(lambda: self._api.store.remove(rtype, namespace or "", name))

    @property
    def resource_version(self) -> int:
        """The current value of the global resourceVersion counter."""
        return self._call(lambda: self._api.store.resource_version)

    # --- requests ------------------------------------------------------------------------------------------

    @property
    def requests(self) -> list[RecordedRequest]:
        """Every request received so far, in order (discovery included)."""
        return self._call(lambda: list(self._api.requests))

    def count(self, method: str, path: str) -> int:
        """How many requests with this method went to exactly this path (query left out)."""
        return sum(1 for r in self.requests if r.method == method and r.path == path)

    # --- failures ------------------------------------------------------------------------------------------

    def refuse_evictions(self, times: int, budget_name: str = "budget") -> None:
        """The next ``times`` evictions of budget-guarded pods answer 429, as a PodDisruptionBudget with no
        disruption allowed would."""

        def arm() -> None:
            self._api.evictions.refusals_left = times
            self._api.evictions.budget_name = budget_name

        self._call(arm)

    def stick_terminating(self, namespace: str, name: str) -> None:
        """The pod's kubelet never confirms a graceful deletion: a delete or eviction leaves it marked with a
        deletionTimestamp until a delete with ``gracePeriodSeconds=0``."""
        self._call(lambda: self._api.store.stuck_terminating.add((namespace, name)))

    def compact(self) -> None:
        """Forget the change history up to now: a watch from an older resourceVersion gets 410 Expired."""
        self._call(self._api.store.compact)


@contextmanager
def kube_emulator(**options: Any) -> Iterator[KubeEmulator]:
    """A started ``KubeEmulator`` (keyword options as its constructor's), stopped on exit."""
    emulator = KubeEmulator(**options)
    emulator.start()
    try:
        yield emulator
    finally:
        emulator.stop()
