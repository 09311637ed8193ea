"""The HTTP face of the emulated API server: an aiohttp low-level handler that parses resource paths
(``/api/v1/...``, ``/apis/<group>/<version>/...``), answers them from the ``ObjectStore`` and streams watches;
every other path (discovery, ``/version``) goes to kmock's ``KubernetesScaffold``.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from tests.kube import errors
from tests.kube.errors import ApiError
from tests.kube.resources import ResourceType, find_resource, resource_named
from tests.kube.selectors import Selector, selector_from_query
from tests.kube.store import Json, ObjectStore, WatchEvent, rfc3339

logger = logging.getLogger(__name__)

PODS = resource_named("pods")


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the server received it, for tests to count and inspect."""

    method: str
    path: str
    query: Mapping[str, str]
    content_type: str
    body: bytes
    user: str = ""  # the bearer token the client presented: who made the request (authorization's subject)

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


@dataclass(frozen=True)
class Target:
    """What a resource path names: the resource (None: not served), namespace ("" if none), name, subresource."""

    rtype: ResourceType | None
    namespace: str
    name: str | None
    subresource: str | None


def parse_target(path: str) -> Target | None:
    """The resource a path addresses, or None for a path that names no resource (discovery, /version, ...)."""
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 3 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 4 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    namespace = ""
    if rest[0] == "namespaces" and len(rest) >= 3:
        inner = find_resource(group, version, rest[2])
        if inner is not None and inner.namespaced:
            namespace, rest = rest[1], rest[2:]
    rtype = find_resource(group, version, rest[0])
    return Target(rtype, namespace, rest[1] if len(rest) > 1 else None, "/".join(rest[2:]) or None)


def _query_int(query: Mapping[str, str], name: str) -> int | None:
    if name not in query or query[name] == "":
        return None
    try:
        return int(query[name])
    except ValueError:
        raise errors.bad_request(f"invalid value for {name}: {query[name]!r}") from None


def _body_json(body: bytes) -> Any:
    if not body:
        return None
    try:
        return json.loads(body)
    except ValueError as exc:
        raise errors.bad_request(f"the request body is not JSON: {exc}") from None


def _response(obj: Mapping[str, Any], status: int = 200) -> web.Response:
    return web.json_response(obj, status=status)


def _success_status(rtype: ResourceType, obj: Mapping[str, Any]) -> Json:
    details: Json = {"name": obj["metadata"]["name"], "kind": rtype.plural, "uid": obj["metadata"].get("uid")}
    if rtype.group:
        details["group"] = rtype.group
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": details}


class EvictionHooks:
    """Test hooks on the Eviction API: answer 429 as a PodDisruptionBudget would, N times."""

    def __init__(self) -> None:
        self.refusals_left = 0
        self.budget_name = "budget"


class ApiHandler:
    """The aiohttp handler of the emulated server (see ``tests.kube.emulator`` for what it reproduces)."""

    def __init__(
        self,
        store: ObjectStore,
        discovery: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
        bookmark_interval_s: float,
        absent: frozenset[str] = frozenset(),
    ) -> None:
        self.store = store
        self.absent = absent  # resources not served (a CRD not installed)
        self.discovery = discovery
        self.bookmark_interval_s = bookmark_interval_s
        self.requests: list[RecordedRequest] = []
        self.evictions = EvictionHooks()
        self.streams: set[asyncio.Task[Any]] = set()

    async def __call__(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await request.read()
        bearer = request.headers.get("Authorization", "")
        user = bearer.removeprefix("Bearer ").strip() if bearer.startswith("Bearer ") else ""
        self.requests.append(
            RecordedRequest(request.method, request.path, dict(request.query), request.content_type, body, user)
        )
        target = parse_target(request.path)
        if target is None:
            if len(request.path) > 1 and request.path.endswith("/"):
                # the client asks for "/api/", "/apis/", "/version/"; kmock matches paths exactly
                request = request.clone(rel_url=request.rel_url.with_path(request.path.rstrip("/")))
            return await self.discovery(request)
        try:
            return await self._serve(request, target, body)
        except ApiError as exc:
            logger.debug("%s %s -> %d %s", request.method, request.path_qs, exc.code, exc.message)
            return web.json_response(exc.status(), status=exc.code, headers=exc.headers)

    async def _serve(self, request: web.BaseRequest, target: Target, body: bytes) -> web.StreamResponse:
        rtype = target.rtype
        if (
            rtype is None
            or rtype.name in self.absent
            or (target.subresource and target.subresource not in rtype.subresources)
        ):
            raise errors.resource_not_found()
        query, method = request.query, request.method
        if "dryRun" in query:
            raise errors.not_emulated("dryRun")
        watching = query.get("watch") in ("true", "1")
        if target.name is None:
            if method == "GET":
                selector = self._selector(rtype, query)
                if watching:
                    return await self._watch(request, rtype, target.namespace, None, selector)
                return self._list(rtype, target.namespace, selector)
            if method == "POST":
                if rtype.namespaced and not target.namespace:
                    raise errors.resource_not_found()
                return _response(self.store.create(rtype, target.namespace, _body_json(body)), 201)
            if method == "DELETE":
                raise errors.not_emulated("deletecollection")
            raise errors.method_not_allowed()
        if rtype.namespaced and not target.namespace:
            raise errors.resource_not_found()
        name, sub = target.name, target.subresource
        if sub == "eviction":
            if method != "POST":
                raise errors.method_not_allowed()
            return self._evict(target.namespace, name, _body_json(body))
        if method == "GET":
            if watching:
                return await self._watch(request, rtype, target.namespace, name, self._selector(rtype, query))
            return _response(self.store.read(rtype, target.namespace, name))
        if method == "PUT":
            obj, created = self.store.replace(rtype, target.namespace, name, _body_json(body), sub)
            return _response(obj, 201 if created else 200)
        if method == "PATCH":
            patch = _body_json(body)
            return _response(self.store.patch(rtype, target.namespace, name, request.content_type, patch, sub))
        if method == "DELETE" and sub is None:
            return self._delete(rtype, target.namespace, name, query, _body_json(body))
        raise errors.method_not_allowed()

    def _selector(self, rtype: ResourceType, query: Mapping[str, str]) -> Selector:
        try:
            return selector_from_query(query, rtype.field_labels)
        except ValueError as exc:
            raise errors.bad_request(str(exc)) from None

    def _list(self, rtype: ResourceType, namespace: str, selector: Selector) -> web.Response:
        items = self.store.select(rtype, namespace or None, selector)
        if not rtype.custom:  # a typed list's items carry no kind/apiVersion; a custom resource list's do
            for item in items:
                item.pop("kind", None)
                item.pop("apiVersion", None)
        return _response(
            {
                "kind": rtype.list_kind,
                "apiVersion": rtype.api_version,
                "metadata": {"resourceVersion": str(self.store.resource_version)},
                "items": items,
            }
        )

    def _delete(
        self, rtype: ResourceType, namespace: str, name: str, query: Mapping[str, str], options: Any
    ) -> web.Response:
        # upstream decodes DeleteOptions from the body when there is one, else from the query
        if isinstance(options, dict) and options:
            grace_s = options.get("gracePeriodSeconds")
            preconditions = options.get("preconditions") or {}
        else:
            grace_s = _query_int(query, "gracePeriodSeconds")
            preconditions = {}
        obj, removed = self.store.delete(rtype, namespace, name, grace_s, preconditions)
        if removed and not rtype.returns_deleted_object:
            return _response(_success_status(rtype, obj))
        return _response(obj)

    def _evict(self, namespace: str, name: str, eviction: Any) -> web.Response:
        """POST pods/<name>/eviction (policy/v1 Eviction): the DisruptionTarget condition, then a delete."""
        if not isinstance(eviction, dict) or (eviction.get("metadata") or {}).get("name") != name:
            raise errors.bad_request("name in URL does not match name in Eviction object")
        pod = self.store.read(PODS, namespace, name)
        phase = (pod.get("status") or {}).get("phase")
        ignores_budget = phase in ("Succeeded", "Failed", "Pending") or bool(pod["metadata"].get("deletionTimestamp"))
        if not ignores_budget and self.evictions.refusals_left > 0:
            self.evictions.refusals_left -= 1
            logger.debug("eviction of %s/%s refused (disruption budget hook)", namespace, name)
            raise errors.disruption_budget(self.evictions.budget_name)

        def add_condition(obj: Json) -> None:
            conditions = obj.setdefault("status", {}).setdefault("conditions", [])
            for condition in conditions:
                if condition.get("type") == "DisruptionTarget":
                    if condition.get("status") == "True" and condition.get("reason") == "EvictionByEvictionAPI":
                        return
                    conditions.remove(condition)
                    break
            conditions.append(
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": "EvictionByEvictionAPI",
                    "message": "Eviction API: evicting",
                    "lastTransitionTime": rfc3339(datetime.datetime.now(datetime.UTC)),
                }
            )

        self.store.modify(PODS, namespace, name, add_condition)
        options = eviction.get("deleteOptions") or {}
        self.store.delete(PODS, namespace, name, options.get("gracePeriodSeconds"), options.get("preconditions"))
        return _response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}, 201)

    async def _watch(
        self, request: web.BaseRequest, rtype: ResourceType, namespace: str, name: str | None, selector: Selector
    ) -> web.StreamResponse:
        query = request.query
        if "sendInitialEvents" in query:
            raise errors.not_emulated("sendInitialEvents (watch list)")
        since = _query_int(query, "resourceVersion")
        since = None if since == 0 else since
        timeout_s = _query_int(query, "timeoutSeconds")
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        try:
            replay, queue = self.store.subscribe(rtype, since)
        except ApiError as exc:  # upstream answers 200 and one ERROR event (an "error watcher")
            await response.prepare(request)
            await self._send(response, {"type": "ERROR", "object": exc.status()})
            await response.write_eof()
            return response
        task = asyncio.current_task()
        assert task is not None
        self.streams.add(task)
        try:
            await response.prepare(request)
            await self._stream(response, rtype, namespace, name, selector, replay, queue, timeout_s, bookmarks)
            await response.write_eof()
        except ConnectionError:
            pass  # the client went away
        finally:
            self.streams.discard(task)
            self.store.unsubscribe(queue)
        return response

    async def _stream(
        self,
        response: web.StreamResponse,
        rtype: ResourceType,
        namespace: str,
        name: str | None,
        selector: Selector,
        replay: list[WatchEvent],
        queue: asyncio.Queue[WatchEvent],
        timeout_s: int | None,
        bookmarks: bool,
    ) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s if timeout_s is not None else None
        next_bookmark = loop.time() + self.bookmark_interval_s

        def seen(obj: Mapping[str, Any] | None) -> bool:
            if obj is None:
                return False
            meta = obj["metadata"]
            in_scope = (not namespace or meta.get("namespace") == namespace) and (name is None or meta["name"] == name)
            return in_scope and selector.matches(obj)

        async def send(event: WatchEvent) -> None:
            # a change that moves an object into or out of the selection is seen as ADDED or DELETED
            now_in, was_in = seen(event.obj), seen(event.previous)
            if event.type == "MODIFIED":
                kind = {(True, True): "MODIFIED", (True, False): "ADDED", (False, True): "DELETED"}.get(
                    (now_in, was_in)
                )
            else:
                kind = event.type if now_in else None
            if kind is not None:
                await self._send(response, {"type": kind, "object": event.obj})

        for event in replay:
            await send(event)
        while True:
            now = loop.time()
            if deadline is not None and now >= deadline:
                return
            wakes = [t for t in (deadline, next_bookmark if bookmarks else None) if t is not None]
            try:
                async with asyncio.timeout(max(min(wakes) - now, 0) if wakes else None):
                    event = await queue.get()
            except TimeoutError:
                if bookmarks and loop.time() >= next_bookmark and queue.empty():
                    rv = str(self.store.resource_version)
                    bookmark = {
                        "kind": rtype.kind,
                        "apiVersion": rtype.api_version,
                        "metadata": {"resourceVersion": rv},
                    }
                    await self._send(response, {"type": "BOOKMARK", "object": bookmark})
                    next_bookmark = loop.time() + self.bookmark_interval_s
                continue
            await send(event)

    @staticmethod
    async def _send(response: web.StreamResponse, event: Mapping[str, Any]) -> None:
        await response.write(json.dumps(event).encode() + b"\n")
