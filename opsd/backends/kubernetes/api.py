"""The calls the Kubernetes backend makes, through the official client (``kubernetes``), as JSON: the one module
that imports the client. Answers are the server's JSON (read raw, not into the client's models: a list of 3,000
nodes is parsed once); the client's ``ApiException`` becomes opsd's errors:

- 404: ``NotFoundError``;
- 409 (a stale resourceVersion, a name taken): ``ConflictError``, a ``TransientError`` (read again and retry);
- 429 (a PodDisruptionBudget, the API's own rate limit), 5xx, a connection that failed or timed out:
  ``TransientError`` with the server's ``Retry-After`` when it gives one;
- anything else (401, 403, 422, ...): ``PermanentError`` naming the call.

``connect`` takes the in-cluster configuration when it runs in a pod (the service account's token), else a
kubeconfig.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import kubernetes.client
import kubernetes.config
import kubernetes.watch
import urllib3.exceptions
from kubernetes.client import ApiException

from opsd.backends.kubernetes.cluster import JOBSET_GROUP, JOBSET_PLURAL, JOBSET_VERSION
from opsd.errors import NotFoundError, PermanentError, TransientError

log = logging.getLogger(__name__)

Json = dict[str, Any]
T = TypeVar("T")
REQUEST_TIMEOUT_S = 10.0


class ConflictError(TransientError):
    """409: the object changed since it was read (or the name is taken): read it again and retry."""


def connect(kubeconfig: str = "", context: str = "") -> kubernetes.client.ApiClient:
    """A client for the cluster: in a pod, the in-cluster configuration; else ``kubeconfig`` (default
    ``$KUBECONFIG`` or ``~/.kube/config``) and its ``context``."""
    try:
        if not kubeconfig and os.environ.get("KUBERNETES_SERVICE_HOST"):
            kubernetes.config.load_incluster_config()
            return kubernetes.client.ApiClient()
        configuration = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(
            config_file=kubeconfig or None, context=context or None, client_configuration=configuration
        )
        return kubernetes.client.ApiClient(configuration)
    except (kubernetes.config.ConfigException, OSError) as exc:
        raise PermanentError(f"no Kubernetes configuration: {exc}") from None


class KubeApi:
    """The backend's view of the API server: nodes, pods, evictions, events, leases and JobSets."""

    def __init__(self, client: kubernetes.client.ApiClient) -> None:
        self.client = client
        self.core = kubernetes.client.CoreV1Api(client)
        self.custom = kubernetes.client.CustomObjectsApi(client)
        self.coordination = kubernetes.client.CoordinationV1Api(client)
        self.apps = kubernetes.client.AppsV1Api(client)

    # -- discovery -----------------------------------------------------------------------------------------------
    def serves(self, group: str, version: str, plural: str) -> bool:
        """Whether the API server serves ``plural`` in ``group/version`` (its discovery document lists it)."""
        try:
            answer = self._json(
                f"discover {group}/{version}",
                lambda: self.custom.get_api_resources(group, version, _preload_content=False),
            )
        except NotFoundError:
            return False
        return any(r.get("name") == plural for r in answer.get("resources") or [])

    # -- nodes ---------------------------------------------------------------------------------------------------
    def node(self, name: str) -> Json:
        return self._json(f"read node {name}", lambda: self.core.read_node(name, _preload_content=False))

    def nodes(self, label_selector: str = "") -> tuple[list[Json], str]:
        """The nodes (matching ``label_selector``) and the list's resourceVersion."""
        answer = self._json(
            "list nodes", lambda: self.core.list_node(label_selector=label_selector or None, _preload_content=False)
        )
        return list(answer.get("items") or []), str(answer["metadata"].get("resourceVersion", ""))

    def replace_node(self, node: Json) -> Json:
        """PUT the whole node: refused with ``ConflictError`` when it changed since it was read (its
        resourceVersion), so that nothing another controller wrote meanwhile is lost."""
        name = node["metadata"]["name"]
        body = _model(kubernetes.client.V1Node, node)
        return self._json(f"replace node {name}", lambda: self.core.replace_node(name, body, _preload_content=False))

    # -- pods ----------------------------------------------------------------------------------------------------
    def pods(self, namespace: str, label_selector: str) -> list[Json]:
        answer = self._json(
            f"list pods in {namespace}",
            lambda: self.core.list_namespaced_pod(namespace, label_selector=label_selector, _preload_content=False),
        )
        return list(answer.get("items") or [])

    def all_pods(self, label_selector: str, namespace: str = "") -> tuple[list[Json], str]:
        """The pods of ``namespace`` (or of every namespace) matching ``label_selector``, and the list's
        resourceVersion."""

        def call() -> Any:
            if namespace:
                return self.core.list_namespaced_pod(namespace, label_selector=label_selector, _preload_content=False)
            return self.core.list_pod_for_all_namespaces(label_selector=label_selector, _preload_content=False)

        answer = self._json(f"list pods in {namespace or 'every namespace'}", call)
        return list(answer.get("items") or []), str(answer["metadata"].get("resourceVersion", ""))

    def evict(self, namespace: str, name: str) -> None:
        """POST an Eviction (policy/v1): the pod gets the condition ``DisruptionTarget`` and is deleted."""
        body = kubernetes.client.V1Eviction(metadata=kubernetes.client.V1ObjectMeta(name=name, namespace=namespace))
        self._call(
            f"evict pod {namespace}/{name}",
            lambda: self.core.create_namespaced_pod_eviction(name, namespace, body, _preload_content=False),
        )

    def delete_pod_now(self, namespace: str, name: str) -> None:
        """Delete a pod with no grace period: for one stuck Terminating on a node that does not answer."""
        self._call(
            f"delete pod {namespace}/{name}",
            lambda: self.core.delete_namespaced_pod(name, namespace, grace_period_seconds=0, _preload_content=False),
        )

    # -- JobSets -------------------------------------------------------------------------------------------------
    def jobset(self, namespace: str, name: str) -> Json:
        return self._json(
            f"read jobset {namespace}/{name}",
            lambda: self.custom.get_namespaced_custom_object(
                JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSET_PLURAL, name, _preload_content=False
            ),
        )

    def jobsets(self, namespace: str = "") -> list[Json]:
        """The JobSets of a namespace, or of every namespace."""
        return self.jobsets_listed(namespace)[0]

    def jobsets_listed(self, namespace: str = "") -> tuple[list[Json], str]:
        """The JobSets of a namespace (or every namespace), and the list's resourceVersion."""

        def call() -> Any:
            if namespace:
                return self.custom.list_namespaced_custom_object(
                    JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSET_PLURAL, _preload_content=False
                )
            return self.custom.list_cluster_custom_object(
                JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL, _preload_content=False
            )

        answer = self._json("list jobsets", call)
        return list(answer.get("items") or []), str((answer.get("metadata") or {}).get("resourceVersion", ""))

    # -- events and the controller's own pod ---------------------------------------------------------------------
    def create_event(self, namespace: str, event: Json) -> bool:
        """Create a core Event; False when one of that name exists already (a step told twice)."""
        try:
            self._call(
                f"create event {event['metadata']['name']}",
                lambda: self.core.create_namespaced_event(
                    namespace, _model(kubernetes.client.CoreV1Event, event), _preload_content=False
                ),
            )
        except ConflictError:
            return False
        return True

    def event(self, namespace: str, name: str) -> Json:
        return self._json(
            f"read event {namespace}/{name}",
            lambda: self.core.read_namespaced_event(name, namespace, _preload_content=False),
        )

    def label_pod(self, namespace: str, name: str, labels: dict[str, str]) -> None:
        """Set labels on a pod (a merge patch of its metadata)."""
        patch = {"metadata": {"labels": labels}}
        self._call(
            f"label pod {namespace}/{name}",
            lambda: self.core.patch_namespaced_pod(name, namespace, patch, _preload_content=False),
        )

    # -- secrets (the chart's credentials) -----------------------------------------------------------------------
    def daemonset(self, namespace: str, name: str) -> Json:
        return self._json(
            f"read daemonset {namespace}/{name}",
            lambda: self.apps.read_namespaced_daemon_set(name, namespace, _preload_content=False),
        )

    def secret(self, namespace: str, name: str) -> Json:
        return self._json(
            f"read secret {namespace}/{name}",
            lambda: self.core.read_namespaced_secret(name, namespace, _preload_content=False),
        )

    def create_secret(self, namespace: str, secret: Json) -> Json:
        body = _model(kubernetes.client.V1Secret, secret)
        return self._json(
            f"create secret {namespace}/{secret['metadata']['name']}",
            lambda: self.core.create_namespaced_secret(namespace, body, _preload_content=False),
        )

    def replace_secret(self, namespace: str, secret: Json) -> Json:
        """PUT the Secret whole, refused with ``ConflictError`` when it changed since it was read."""
        name = secret["metadata"]["name"]
        body = _model(kubernetes.client.V1Secret, secret)
        return self._json(
            f"replace secret {namespace}/{name}",
            lambda: self.core.replace_namespaced_secret(name, namespace, body, _preload_content=False),
        )

    # -- watches -------------------------------------------------------------------------------------------------
    def watch(self, kind: str, resource_version: str, timeout_s: int, **selectors: str) -> Iterator[Json]:
        """The raw events of a watch on ``kind`` (``nodes``, ``pods``: ``namespace`` and ``label_selector`` as
        selectors; ``jobsets``) from ``resource_version``, bookmarks asked for, until ``timeout_s``."""
        namespace = selectors.pop("namespace", "")
        if kind == "nodes":
            func: Callable[..., Any] = self.core.list_node
            args: tuple[Any, ...] = ()
        elif kind == "pods" and namespace:
            func, args = self.core.list_namespaced_pod, (namespace,)
        elif kind == "pods":
            func, args = self.core.list_pod_for_all_namespaces, ()
        elif kind == "jobsets":
            func = self.custom.list_namespaced_custom_object if namespace else self.custom.list_cluster_custom_object
            args = (JOBSET_GROUP, JOBSET_VERSION, *((namespace,) if namespace else ()), JOBSET_PLURAL)
        else:
            raise ValueError(f"cannot watch {kind!r}")
        stream = kubernetes.watch.Watch().stream(
            func,
            *args,
            resource_version=resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=timeout_s,
            _request_timeout=timeout_s + REQUEST_TIMEOUT_S,
            **{k: v for k, v in selectors.items() if v},
        )
        try:
            for event in stream:
                yield {"type": event["type"], "object": event["raw_object"]}
        except ApiException as exc:
            raise _error(f"watch {kind}", exc) from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise TransientError(f"watch {kind}: {exc}") from None

    # -- plumbing ------------------------------------------------------------------------------------------------
    def _json(self, what: str, call: Callable[[], Any]) -> Json:
        response = self._call(what, call)
        data: Json = json.loads(response.data or b"{}")
        return data

    def _call(self, what: str, call: Callable[[], T]) -> T:
        try:
            return call()
        except ApiException as exc:
            raise _error(what, exc) from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise TransientError(f"{what}: {exc}") from None


M = TypeVar("M")


def _model(cls: type[M], data: Json) -> M:
    """The client's model of ``data`` (its ``from_dict``), for the calls that take one."""
    model = cls.from_dict(data)  # type: ignore[attr-defined]
    if model is None:
        raise PermanentError(f"not a {cls.__name__}: {data!r:.200}")
    return model  # type: ignore[no-any-return]


def _error(what: str, exc: ApiException) -> Exception:
    """opsd's error for an API server's answer."""
    message = f"{what}: {exc.status} {_reason(exc)}"
    status = exc.status or 0
    if status == 404:
        return NotFoundError(message)
    if status == 409:
        return ConflictError(message, retry_after_s=0.0)
    if status == 429 or status >= 500 or status == 0:
        return TransientError(message, retry_after_s=_retry_after_s(exc))
    return PermanentError(message)


def _reason(exc: ApiException) -> str:
    try:
        body = json.loads(exc.body or "{}")
    except (ValueError, TypeError):
        body = {}
    return str(body.get("message") or exc.reason or "")


def _retry_after_s(exc: ApiException) -> float:
    headers = exc.headers or {}
    try:
        return max(0.0, float(headers.get("Retry-After", 1.0)))
    except (TypeError, ValueError):
        return 1.0
