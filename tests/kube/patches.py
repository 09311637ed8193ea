"""The three PATCH bodies the API server accepts from clients, applied to an object as plain JSON.

- ``application/merge-patch+json``: RFC 7386. Maps merge recursively, ``null`` deletes a key, every list is
  replaced whole.
- ``application/strategic-merge-patch+json``: like a merge patch, except for the lists whose Go type carries a
  ``patchMergeKey`` (merged item by item on that key) or ``patchStrategy: merge`` on a list of strings (a union).
  Only the lists in ``MERGE_KEYS`` are merged here; every other list is replaced, which is what the real server
  does for lists without a merge key, such as a Node's ``spec.taints`` and a Pod's ``spec.tolerations``.
  Patch directives (``$patch``, ``$retainKeys``, ``$deleteFromPrimitiveList``, ``$setElementOrder``) are refused.
- ``application/json-patch+json``: RFC 6902 (add, remove, replace, move, copy, test) through ``jsonpatch``; any
  failure to apply, a failed ``test`` included, is the server's 422.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import jsonpatch

from tests.kube.errors import bad_request, not_emulated, unprocessable, unsupported_media_type

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"

# Lists merged by a strategic merge patch, by their path in the object (list positions left out): the merge key,
# or "" for a list of strings merged as a set. From the ``patchMergeKey``/``patchStrategy`` tags in k8s.io/api.
MERGE_KEYS: Mapping[tuple[str, ...], str] = {
    ("metadata", "finalizers"): "",
    ("metadata", "ownerReferences"): "uid",
    ("status", "conditions"): "type",
    ("status", "addresses"): "type",
    ("spec", "containers"): "name",
    ("spec", "initContainers"): "name",
    ("spec", "volumes"): "name",
}


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: the document ``target`` with ``patch`` merged in (neither argument is changed)."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result: dict[str, Any] = copy.deepcopy(dict(target)) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _refuse_directives(patch: Any) -> None:
    if isinstance(patch, Mapping):
        for key, value in patch.items():
            if isinstance(key, str) and key.startswith("$"):
                raise not_emulated(f"strategic merge patch directive {key}")
            _refuse_directives(value)
    elif isinstance(patch, list):
        for item in patch:
            _refuse_directives(item)


def _merge_list(current: list[Any], patch: list[Any], key: str, path: tuple[str, ...]) -> list[Any]:
    if key == "":
        return list(current) + [item for item in patch if item not in current]
    result = [copy.deepcopy(item) for item in current]
    for item in patch:
        if not isinstance(item, Mapping) or key not in item:
            raise bad_request(f"map: {item!r} does not contain declared merge key: {key}")
        for i, existing in enumerate(result):
            if isinstance(existing, Mapping) and existing.get(key) == item[key]:
                result[i] = _strategic(existing, item, path)
                break
        else:
            result.append(_strategic({}, item, path))
    return result


def _strategic(target: Any, patch: Any, path: tuple[str, ...]) -> Any:
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result: dict[str, Any] = copy.deepcopy(dict(target)) if isinstance(target, Mapping) else {}
    for name, value in patch.items():
        child = (*path, name)
        if value is None:
            result.pop(name, None)
        elif isinstance(value, list) and child in MERGE_KEYS and isinstance(result.get(name), list):
            result[name] = _merge_list(result[name], value, MERGE_KEYS[child], child)
        else:
            result[name] = _strategic(result.get(name), value, child)
    return result


def strategic_merge_patch(target: Mapping[str, Any], patch: Any) -> dict[str, Any]:
    """A strategic merge patch of a built-in object (see the module docstring for the lists it merges)."""
    if not isinstance(patch, Mapping):
        raise bad_request("json: cannot unmarshal array into Go value of type map[string]interface {}")
    _refuse_directives(patch)
    result = _strategic(target, patch, ())
    assert isinstance(result, dict)
    return result


def json_patch(target: Mapping[str, Any], patch: Any) -> dict[str, Any]:
    """RFC 6902 operations applied in order; a failed ``test`` or a bad path is a 422, a non-list body a 400."""
    if not isinstance(patch, list):
        raise bad_request("json: cannot unmarshal object into Go value of type jsonpatch.Patch")
    try:
        result = jsonpatch.apply_patch(copy.deepcopy(dict(target)), patch)
    except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
        raise unprocessable(str(exc)) from exc
    if not isinstance(result, dict):
        raise unprocessable("the patched document is not an object")
    return result


def apply_patch(target: Mapping[str, Any], content_type: str, patch: Any, *, custom: bool) -> dict[str, Any]:
    """The object after a PATCH with this ``Content-Type`` (custom resources take no strategic merge patch)."""
    if content_type == MERGE_PATCH:
        if not isinstance(patch, Mapping):
            raise bad_request("invalid JSON Patch")
        result = merge_patch(target, patch)
        assert isinstance(result, dict)
        return result
    if content_type == JSON_PATCH:
        return json_patch(target, patch)
    if content_type == STRATEGIC_MERGE_PATCH and not custom:
        return strategic_merge_patch(target, patch)
    if content_type == APPLY_PATCH:
        raise not_emulated("server-side apply (application/apply-patch+yaml)")
    accepted = (JSON_PATCH, MERGE_PATCH) if custom else (JSON_PATCH, MERGE_PATCH, STRATEGIC_MERGE_PATCH)
    raise unsupported_media_type(content_type, (*accepted, APPLY_PATCH))
