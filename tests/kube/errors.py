"""The API server's failure answers: an HTTP status with a ``v1 Status`` body, worded as the real server words
them (k8s.io/apimachinery ``pkg/api/errors``), so that clients that read ``reason`` or ``code`` behave alike."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tests.kube.resources import ResourceType


class ApiError(Exception):
    """A failure the emulated server answers with ``code`` and a ``Status`` body (plus ``headers``)."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        details: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(f"{code} {reason}: {message}")
        self.code = code
        self.reason = reason
        self.message = message
        self.details = dict(details or {})
        self.headers = dict(headers or {})

    def status(self) -> dict[str, Any]:
        """The ``Status`` object sent as the body (or as the object of a watch ERROR event)."""
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details:
            body["details"] = self.details
        return body


def _qualified(rtype: ResourceType) -> str:
    return f"{rtype.plural}.{rtype.group}" if rtype.group else rtype.plural


def _details(rtype: ResourceType, name: str) -> dict[str, Any]:
    details: dict[str, Any] = {"name": name, "kind": rtype.plural}
    if rtype.group:
        details["group"] = rtype.group
    return details


def not_found(rtype: ResourceType, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{_qualified(rtype)} "{name}" not found', _details(rtype, name))


def namespace_not_found(namespace: str) -> ApiError:
    return ApiError(404, "NotFound", f'namespaces "{namespace}" not found', {"name": namespace, "kind": "namespaces"})


def resource_not_found() -> ApiError:
    return ApiError(404, "NotFound", "the server could not find the requested resource")


def already_exists(rtype: ResourceType, name: str) -> ApiError:
    return ApiError(409, "AlreadyExists", f'{_qualified(rtype)} "{name}" already exists', _details(rtype, name))


def conflict(rtype: ResourceType, name: str, why: str) -> ApiError:
    return ApiError(
        409, "Conflict", f'Operation cannot be fulfilled on {_qualified(rtype)} "{name}": {why}', _details(rtype, name)
    )


def stale_conflict(rtype: ResourceType, name: str) -> ApiError:
    return conflict(
        rtype, name, "the object has been modified; please apply your changes to the latest version and try again"
    )


def invalid(rtype: ResourceType, name: str, field: str, message: str) -> ApiError:
    return ApiError(
        422,
        "Invalid",
        f'{rtype.kind}.{rtype.group or "core"} "{name}" is invalid: {field}: {message}',
        {**_details(rtype, name), "causes": [{"reason": "FieldValueInvalid", "message": message, "field": field}]},
    )


def unprocessable(message: str) -> ApiError:
    """A JSON patch that fails to apply (a ``test`` op included): the server's generic 422."""
    return ApiError(422, "Invalid", message)


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def method_not_allowed() -> ApiError:
    return ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")


def unsupported_media_type(content_type: str, accepted: tuple[str, ...]) -> ApiError:
    return ApiError(
        415,
        "UnsupportedMediaType",
        f"the body of the request was in an unknown format - accepted media types include: {', '.join(accepted)}",
        {"causes": [{"reason": "UnexpectedHeader", "message": content_type}]},
    )


def internal(message: str) -> ApiError:
    return ApiError(500, "InternalError", f"Internal error occurred: {message}", {"causes": [{"message": message}]})


def not_emulated(what: str) -> ApiError:
    """A request the real server would serve but the emulator does not reproduce: fail loudly, never pretend."""
    return ApiError(501, "NotImplemented", f"not emulated by tests.kube: {what}")


def expired(requested_rv: int, compacted_rv: int) -> ApiError:
    """A watch from a resourceVersion older than the retained history: the watch cache's wording, with the
    newest resourceVersion whose change is no longer retained."""
    return ApiError(410, "Expired", f"too old resource version: {requested_rv} ({compacted_rv})")


def too_large_resource_version(requested_rv: int, current_rv: int) -> ApiError:
    return ApiError(
        504,
        "Timeout",
        f"Too large resource version: {requested_rv}, current: {current_rv}",
        {
            "causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
            "retryAfterSeconds": 1,
        },
    )


def disruption_budget(budget_name: str) -> ApiError:
    """The eviction answer when a PodDisruptionBudget allows no disruption (pkg/registry/core/pod/storage)."""
    return ApiError(
        429,
        "TooManyRequests",
        "Cannot evict pod as it would violate the pod's disruption budget.",
        {
            "causes": [
                {
                    "reason": "DisruptionBudget",
                    "message": f"The disruption budget {budget_name} needs 1 healthy pods and has 1 currently",
                }
            ]
        },
    )
