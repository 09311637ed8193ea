"""Write the JSON schema of a custom resource from its CRD, kept to the fields a manifest of ours sets.

The tests validate the chart's ServiceMonitor, PodMonitor and PrometheusRule and the docs' JobSet against the
schemas in ``tests/schemas/``, which this script makes from the upstream CRD files (read where the header of each
schema says). From the CRD's ``openAPIV3Schema`` of one version:

- every property name is kept and every object refuses unknown ones (``additionalProperties: false``, as the API
  server's pruning of a structural schema would drop them), except where the CRD preserves unknown fields;
- the properties on the way to, or under, a ``--keep`` path are converted whole (types, enums, patterns, required
  lists); the others keep only their type;
- a ``--external`` path is replaced by a plain object that the tests check by other means (the JobSet's Job
  template is a batch/v1 JobTemplateSpec, which kubernetes-validate knows);
- descriptions, defaults and CEL rules are dropped, and so are patterns with RE2 inline flags (not ECMA-262
  regular expressions); metadata is limited to name, namespace, labels, annotations.

    python tools/crd_schema.py CRD.yaml --kind ServiceMonitor --source "..." --keep spec.endpoints -o OUT.json

Paths are dotted property names; arrays are transparent (``spec.endpoints.port`` is the port of every endpoint).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]  # PyYAML ships no type information

Json = dict[str, Any]

KEPT_KEYWORDS = ("type", "enum", "pattern", "minimum", "maximum", "minLength", "maxLength", "minItems", "maxItems")

METADATA: Json = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 253},
        "namespace": {"type": "string", "minLength": 1, "maxLength": 63},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


def is_kept(path: tuple[str, ...], keep: list[tuple[str, ...]]) -> bool:
    """On the way to a kept path, or under one."""
    return any(k[: len(path)] == path or path[: len(k)] == k for k in keep)


def shallow(node: Json) -> Json:
    if node.get("x-kubernetes-int-or-string"):
        return {"anyOf": [{"type": "integer"}, {"type": "string"}]}
    return {"type": node["type"]} if "type" in node else {}


def convert(node: Json, path: tuple[str, ...], keep: list[tuple[str, ...]], external: list[tuple[str, ...]]) -> Json:
    if path in external:
        return {"type": "object", "$comment": "checked by the tests with kubernetes-validate, not by this schema"}
    if node.get("x-kubernetes-int-or-string"):
        return {"anyOf": [{"type": "integer"}, {"type": "string"}]}
    if "anyOf" in node and "type" not in node:
        return {"anyOf": [convert(n, path, keep, external) for n in node["anyOf"]]}
    out: Json = {k: node[k] for k in KEPT_KEYWORDS if k in node}
    if "pattern" in out and "(?" in out["pattern"]:
        del out["pattern"]  # RE2 inline flags, e.g. "^(?i)(abort|warn)?$": not a JSON Schema (ECMA-262) regex
    if node.get("type") == "array" and "items" in node:
        out["items"] = convert(node["items"], path, keep, external)
    if node.get("type") == "object":
        props = node.get("properties")
        if props is not None:
            out["properties"] = {
                name: convert(sub, (*path, name), keep, external) if is_kept((*path, name), keep) else shallow(sub)
                for name, sub in props.items()
            }
            if "required" in node:
                out["required"] = node["required"]
        if node.get("x-kubernetes-preserve-unknown-fields"):
            pass
        elif isinstance(node.get("additionalProperties"), dict):
            out["additionalProperties"] = convert(node["additionalProperties"], path, keep, external)
        elif props is not None:
            out["additionalProperties"] = False
    return out


def crd_schema(crd: Json, kind: str, version: str | None, source: str, keep: list[str], external: list[str]) -> Json:
    group = crd["spec"]["group"]
    versions = crd["spec"]["versions"]
    ver = next(v for v in versions if v["name"] == version) if version else versions[0]
    root = ver["schema"]["openAPIV3Schema"]
    keep_paths = [tuple(k.split(".")) for k in keep]
    external_paths = [tuple(k.split(".")) for k in external]
    spec = convert(root["properties"]["spec"], ("spec",), keep_paths, external_paths)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$comment": (
            f"{kind} {group}/{ver['name']}, from {source}: openAPIV3Schema of version {ver['name']}, by "
            f"tools/crd_schema.py (kept whole: {', '.join(keep)}; other fields: type only"
            + (f"; checked elsewhere: {', '.join(external)}" if external else "")
            + ")."
        ),
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", *(["spec"] if "spec" in root.get("required", []) else [])],
        "properties": {
            "apiVersion": {"const": f"{group}/{ver['name']}"},
            "kind": {"const": kind},
            "metadata": METADATA,
            "spec": spec,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("crd", type=Path, help="the CRD's YAML file")
    parser.add_argument("--kind", required=True)
    parser.add_argument("--version", help="the CRD version (default: the first)")
    parser.add_argument("--source", required=True, help="where the CRD came from (repository, tag, path, commit)")
    parser.add_argument("--keep", action="append", default=[], help="a dotted path converted whole (repeatable)")
    parser.add_argument("--external", action="append", default=[], help="a dotted path checked elsewhere")
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args(argv)
    crd = yaml.safe_load(args.crd.read_text())
    schema = crd_schema(crd, args.kind, args.version, args.source, args.keep, args.external)
    args.output.write_text(json.dumps(schema, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
