"""The nodes opsd manages, as label selectors ORed: ``controller.kubernetes.node_selector``.

A Kubernetes label selector ANDs its requirements and cannot say "a GPU node of the GPU Operator, or of GKE, or of
NFD"; each platform labels its GPU nodes its own way. So ``node_selector`` is one or more label selectors separated
by ``;``, a node matching any of them (the chart writes it from the agents' required node affinity terms):

    selector = NodeSelector.parse("nvidia.com/gpu.present=true; cloud.google.com/gke-accelerator")
    selector.server_side        # "": two terms, so the nodes are listed whole and matched here
    selector.matches({"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"})   # True

One term is given to the API server as it is (``server_side``), as before. Each term is a label selector in the API
server's syntax: requirements separated by ``,``, each ``key``, ``!key``, ``key=value`` (or ``==``), ``key!=value``,
``key in (a,b)`` or ``key notin (a,b)``. An empty text is every node.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_KEY = r"[A-Za-z0-9][-A-Za-z0-9_./]*"
_VALUE = r"[-A-Za-z0-9_.]*"
_SET = re.compile(rf"^({_KEY})\s+(in|notin)\s+\(\s*({_VALUE}(?:\s*,\s*{_VALUE})*)\s*\)$")
_EQUALS = re.compile(rf"^({_KEY})\s*(==|=|!=)\s*({_VALUE})$")
_EXISTS = re.compile(rf"^(!?)\s*({_KEY})$")


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: str  # in, notin, exists, !exists
    values: frozenset[str] = frozenset()

    def holds(self, labels: Mapping[str, str]) -> bool:
        if self.operator == "exists":
            return self.key in labels
        if self.operator == "!exists":
            return self.key not in labels
        if self.operator == "in":
            return self.key in labels and labels[self.key] in self.values
        return self.key not in labels or labels[self.key] not in self.values  # notin, as the API server reads it


def _split(term: str) -> list[str]:
    """A term's requirements: split on the commas outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(term):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(term[start:i])
            start = i + 1
    parts.append(term[start:])
    return [p.strip() for p in parts]


def _requirement(text: str) -> Requirement:
    if found := _SET.match(text):
        values = frozenset(v.strip() for v in found.group(3).split(","))
        return Requirement(found.group(1), found.group(2), values)
    if found := _EQUALS.match(text):
        operator = "notin" if found.group(2) == "!=" else "in"
        return Requirement(found.group(1), operator, frozenset({found.group(3)}))
    if found := _EXISTS.match(text):
        return Requirement(found.group(2), "!exists" if found.group(1) else "exists")
    raise ValueError(f"not a label selector requirement: {text!r}")


@dataclass(frozen=True)
class NodeSelector:
    text: str
    terms: tuple[tuple[Requirement, ...], ...]  # ORed; each ANDs its requirements; none: every node

    @classmethod
    def parse(cls, text: str) -> NodeSelector:
        """``ValueError`` naming the requirement that is not one."""
        terms = []
        for term in text.split(";"):
            if term.strip():
                terms.append(tuple(_requirement(r) for r in _split(term.strip())))
        return cls(text, tuple(terms))

    @property
    def server_side(self) -> str:
        """What the API server can select by itself: the one term as written, or "" (every node, matched here)."""
        parts = [t for t in self.text.split(";") if t.strip()]
        return parts[0].strip() if len(parts) == 1 else ""

    def matches(self, labels: Mapping[str, str]) -> bool:
        return not self.terms or any(all(r.holds(labels) for r in term) for term in self.terms)

    def matches_node(self, node: Mapping[str, Any]) -> bool:
        return self.matches((node.get("metadata") or {}).get("labels") or {})
