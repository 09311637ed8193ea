"""Label and field selectors as the API server parses and applies them (k8s.io/apimachinery ``pkg/labels`` and
``pkg/fields``).

Label selector: comma-separated requirements ``a=b`` (or ``a==b``), ``a!=b``, ``a``, ``!a``, ``a in (x,y)``,
``a notin (x,y)``. ``!=`` and ``notin`` also match objects without the label, as upstream. A malformed selector
raises ``ValueError`` (the server answers 400). The numeric ``a>1``/``a<1`` forms are not accepted here.

Field selector: comma-separated ``key=value``, ``key==value``, ``key!=value`` over the keys a resource supports;
a missing field reads as ``""`` (so ``spec.nodeName=`` selects unscheduled pods), a boolean as ``true``/``false``.
An unsupported key raises ``ValueError`` (``field label not supported: <key>``, a 400 upstream).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
_KEY = re.compile(rf"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?{_NAME}$")
_VALUE = re.compile(rf"^({_NAME})?$")
_SET_FORM = re.compile(r"^(?P<key>[^\s!=()]+)\s+(?P<op>in|notin)\s*\((?P<values>[^()]*)\)$")
_COMPARE_FORM = re.compile(r"^(?P<key>[^\s!=()]+)\s*(?P<op>==|=|!=)\s*(?P<value>[^\s!=(),]*)$")
_NOT_EXISTS_FORM = re.compile(r"^!\s*(?P<key>[^\s!=()]+)$")


@dataclass(frozen=True)
class LabelRequirement:
    """One requirement of a label selector: ``key <op> values``."""

    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!exists"
    values: frozenset[str]

    def matches(self, labels: Mapping[str, str]) -> bool:
        has = self.key in labels
        if self.op in ("=", "in"):
            return has and labels[self.key] in self.values
        if self.op in ("!=", "notin"):
            return not has or labels[self.key] not in self.values
        if self.op == "exists":
            return has
        return not has


def _split_requirements(selector: str) -> list[str]:
    """Split at commas outside parentheses."""
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for ch in selector:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return [p.strip() for p in parts]


def _check_key(key: str) -> str:
    if not _KEY.match(key) or len(key.rsplit("/", 1)[-1]) > 63:
        raise ValueError(f"unable to parse requirement: invalid label key {key!r}")
    return key


def _check_value(value: str) -> str:
    if not _VALUE.match(value) or len(value) > 63:
        raise ValueError(f"unable to parse requirement: invalid label value {value!r}")
    return value


def parse_label_selector(selector: str) -> tuple[LabelRequirement, ...]:
    """The requirements of a ``labelSelector`` (all must hold); an empty selector selects everything."""
    if not selector.strip():
        return ()
    requirements: list[LabelRequirement] = []
    for part in _split_requirements(selector):
        if m := _SET_FORM.match(part):
            values = [v.strip() for v in m["values"].split(",")]
            if values == [""]:
                raise ValueError(f"for 'in', 'notin' operators, values set can't be empty: {part!r}")
            requirements.append(
                LabelRequirement(_check_key(m["key"]), m["op"], frozenset(_check_value(v) for v in values))
            )
        elif m := _NOT_EXISTS_FORM.match(part):
            requirements.append(LabelRequirement(_check_key(m["key"]), "!exists", frozenset()))
        elif m := _COMPARE_FORM.match(part):
            op = "=" if m["op"] in ("=", "==") else "!="
            requirements.append(LabelRequirement(_check_key(m["key"]), op, frozenset({_check_value(m["value"])})))
        elif part and _KEY.match(part):
            requirements.append(LabelRequirement(part, "exists", frozenset()))
        else:
            raise ValueError(f"unable to parse requirement: {part!r}")
    return tuple(requirements)


@dataclass(frozen=True)
class FieldRequirement:
    """One requirement of a field selector: ``key = value`` or ``key != value``."""

    key: str
    equal: bool
    value: str


def _split_unescaped(text: str, sep: str) -> list[str]:
    parts: list[str] = []
    current: list[str] = []
    escaped = False
    for ch in text:
        if escaped:
            current.append("\\" + ch)
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == sep:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return parts


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text)


def parse_field_selector(selector: str, supported: frozenset[str]) -> tuple[FieldRequirement, ...]:
    """The requirements of a ``fieldSelector``; keys outside ``supported`` (plus the metadata ones) are refused."""
    if not selector.strip():
        return ()
    allowed = supported | {"metadata.name", "metadata.namespace"}
    requirements: list[FieldRequirement] = []
    for part in _split_unescaped(selector, ","):
        m = re.match(r"^(?P<key>[^=!]+?)\s*(?P<op>==|=|!=)(?P<value>.*)$", part.strip())
        if not m:
            raise ValueError(f"invalid selector: {part!r}; can't understand {part!r}")
        key = m["key"].strip()
        if key not in allowed:
            raise ValueError(f"field label not supported: {key}")
        requirements.append(FieldRequirement(key, m["op"] != "!=", _unescape(m["value"])))
    return tuple(requirements)


def field_value(obj: Mapping[str, Any], dotted: str) -> str:
    """The field's value as the server's field index holds it: a string, ``""`` when missing."""
    value: Any = obj
    for step in dotted.split("."):
        value = value.get(step) if isinstance(value, Mapping) else None
    if value is None:
        return "false" if dotted == "spec.unschedulable" else ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@dataclass(frozen=True)
class Selector:
    """A label selector and a field selector together, as one list or watch request carries them."""

    labels: tuple[LabelRequirement, ...] = ()
    fields: tuple[FieldRequirement, ...] = ()

    def matches(self, obj: Mapping[str, Any]) -> bool:
        metadata = obj.get("metadata") or {}
        labels = metadata.get("labels") or {}
        if not all(r.matches(labels) for r in self.labels):
            return False
        return all((field_value(obj, r.key) == r.value) == r.equal for r in self.fields)


def selector_from_query(query: Mapping[str, str], supported_fields: frozenset[str]) -> Selector:
    """The selector of a request's ``labelSelector`` and ``fieldSelector`` parameters (ValueError if malformed)."""
    return Selector(
        labels=parse_label_selector(query.get("labelSelector", "")),
        fields=parse_field_selector(query.get("fieldSelector", ""), supported_fields),
    )
