"""opsd's Grafana dashboards, built from code: Training, Communication, Stragglers, Reliability and GPU health.

Each dashboard is a plain dict in Grafana's JSON model (built with the typed builders of Grafana's foundation SDK:
``opsd.dashboards.widgets``) with a stable ``uid``, a ``datasource`` variable (any Prometheus) and query variables
``run``, ``node`` and ``rank`` where its panels filter by them. The JSON files in ``dashboards/`` are written by
``python -m opsd.dashboards write dashboards``; ``check DIR`` says whether the files there are what this module
builds. ``validate`` finds what Grafana's dashboard model does not have or types otherwise
(``opsd.dashboards.schema``) and what Grafana would silently show wrong (a query on another data source, a ``$var``
that no variable defines, a variable nothing uses, duplicate ids); ``panel_queries`` gives every panel's PromQL with
the variables substituted as Grafana's Prometheus data source does, to run against a real Prometheus. The panels
themselves are in ``opsd.dashboards.panels``; docs/dashboards.md describes every one.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from opsd.dashboards.panels import BUILDERS
from opsd.dashboards.schema import schema_problems
from opsd.dashboards.widgets import DATASOURCE

PANEL_TYPES = ("timeseries", "stat", "heatmap", "table")
# Grafana's own variables (https://grafana.com/docs/grafana/latest/dashboards/variables/add-template-variables/)
BUILTIN_VARIABLES = frozenset(
    {"__rate_interval", "__interval", "__interval_ms", "__range", "__range_s", "__range_ms", "__from", "__to"}
    | {"__dashboard", "__org", "__user", "__name", "__rate_interval_ms", "timeFilter", "__timeFilter"}
)
# $name, ${name}, ${name:format}, [[name]], [[name:format]]
_REFERENCE = re.compile(r"\$(\w+)|\$\{(\w+)(?::[^}]*)?\}|\[\[(\w+)(?::[^\]]*)?\]\]")
_UID = re.compile(r"^[A-Za-z0-9_-]{1,40}$")
_REGEX_SPECIAL = re.compile(r"([\\^$.|?*+()\[\]{}])")


def build_all() -> dict[str, dict[str, Any]]:
    """Every dashboard, by file name (without ``.json``)."""
    return {name: build() for name, build in BUILDERS.items()}


def render(board: Mapping[str, Any]) -> str:
    """The file's text: what ``write`` writes and ``check`` compares."""
    return json.dumps(board, indent=2) + "\n"


def write(directory: Path) -> list[Path]:
    """Write ``DIRECTORY/<name>.json`` for every dashboard; returns the paths."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, board in build_all().items():
        path = directory / f"{name}.json"
        path.write_text(render(board))
        written.append(path)
    return written


def check(directory: Path) -> list[str]:
    """The files in ``directory`` that differ from (or miss) what this module builds."""
    return [
        f"{directory / name}.json"
        for name, board in build_all().items()
        if not (directory / f"{name}.json").exists() or (directory / f"{name}.json").read_text() != render(board)
    ]


# -- checks ----------------------------------------------------------------------------------------------------------
def references(text: str) -> set[str]:
    """The variable names ``text`` refers to (``$x``, ``${x}``, ``${x:fmt}``, ``[[x]]``)."""
    return {next(g for g in m.groups() if g) for m in _REFERENCE.finditer(text)}


def _targets(board: Mapping[str, Any]) -> Iterator[tuple[Mapping[str, Any], Mapping[str, Any]]]:
    for p in board.get("panels", []):
        for t in p.get("targets", []):
            yield p, t


def validate(dashboards: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> list[str]:
    """The problems of one dashboard or of several (then also: dashboard uids, titles and panel ids repeated across
    them). An empty list: none."""
    boards = [dashboards] if isinstance(dashboards, Mapping) else list(dashboards)
    problems = [p for board in boards for p in _validate_one(board)]
    seen: dict[str, dict[Any, int]] = {"uid": {}, "title": {}, "panel id": {}}
    for i, board in enumerate(boards):
        keys = [("uid", board.get("uid")), ("title", board.get("title"))]
        keys += [("panel id", p.get("id")) for p in board.get("panels", [])]
        for kind, key in keys:
            first = seen[kind].setdefault(key, i)
            if key is not None and first != i:
                other = boards[first].get("title") or boards[first].get("uid")
                problems.append(f"{board.get('title') or board.get('uid')}: {kind} {key!r} is also used by {other}")
    return problems


def _validate_one(board: Mapping[str, Any]) -> list[str]:
    name = str(board.get("title") or board.get("uid") or "dashboard")
    problems = schema_problems(board)
    if not board.get("title"):
        problems.append(f"{name}: no title")
    if not isinstance(board.get("uid"), str) or not _UID.match(board["uid"]):
        problems.append(f"{name}: uid {board.get('uid')!r} is not 1-40 letters, digits, '-' or '_'")
    if not isinstance(board.get("schemaVersion"), int):
        problems.append(f"{name}: no schemaVersion")
    variables = board.get("templating", {}).get("list", [])
    names = [v.get("name") for v in variables]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"{name}: variable {dup!r} is defined more than once")
    defined = set(names)
    if not any(v.get("name") == "datasource" and v.get("type") == "datasource" for v in variables):
        problems.append(f"{name}: no datasource variable (type datasource)")
    elif any(v.get("name") == "datasource" and v.get("query") != "prometheus" for v in variables):
        problems.append(f"{name}: the datasource variable does not list Prometheus data sources")
    used: dict[str, int] = dict.fromkeys(defined, 0)

    def refer(where: str, text: str, own: str | None = None) -> None:
        for ref in references(text):
            if ref in BUILTIN_VARIABLES:
                continue
            if ref not in defined:
                problems.append(f"{name}: {where} refers to ${ref}, which no variable defines")
            elif ref != own:
                used[ref] += 1

    for v in variables:
        if v.get("type") == "query":
            query = v.get("query")
            text = query.get("query", "") if isinstance(query, Mapping) else str(query or "")
            refer(f"variable {v.get('name')!r}", text + json.dumps(v.get("datasource", {})), own=v.get("name"))
            if v.get("datasource") != DATASOURCE:
                problems.append(f"{name}: variable {v.get('name')!r} does not query ${{datasource}}")
    ids: list[Any] = []
    for p in board.get("panels", []):
        where = f"panel {p.get('title') or p.get('id')!r}"
        ids.append(p.get("id"))
        if not isinstance(p.get("id"), int):
            problems.append(f"{name}: {where} has no integer id")
        if not p.get("title"):
            problems.append(f"{name}: panel {p.get('id')!r} has no title")
        if p.get("type") not in PANEL_TYPES:
            problems.append(f"{name}: {where} is of type {p.get('type')!r}, not one of {', '.join(PANEL_TYPES)}")
        if not p.get("targets"):
            problems.append(f"{name}: {where} has no queries")
        refer(where, json.dumps(p.get("datasource", {})) + str(p.get("title", "")) + str(p.get("description", "")))
        if p.get("datasource") != DATASOURCE:
            problems.append(f"{name}: {where} does not use the datasource variable")
        refs = [t.get("refId") for t in p.get("targets", [])]
        if len(set(refs)) != len(refs):
            problems.append(f"{name}: {where} repeats a refId")
        for t in p.get("targets", []):
            if t.get("datasource") != DATASOURCE:
                problems.append(f"{name}: {where} query {t.get('refId')} does not use the datasource variable")
            if not str(t.get("expr", "")).strip():
                problems.append(f"{name}: {where} query {t.get('refId')} has no expression")
            text = str(t.get("expr", "")) + str(t.get("legendFormat", "")) + json.dumps(t.get("datasource", {}))
            refer(f"{where} query {t.get('refId')}", text)
    titles = [p.get("title") for p in board.get("panels", [])]
    for dup in sorted({t for t in titles if t and titles.count(t) > 1}):
        problems.append(f"{name}: panel title {dup!r} is used more than once")
    for dup in sorted({i for i in ids if ids.count(i) > 1}, key=str):
        problems.append(f"{name}: panel id {dup!r} is used more than once")
    for var, count in sorted(used.items()):
        if count == 0:
            problems.append(f"{name}: variable {var!r} is not used by any panel or variable")
    return problems


# -- the queries, as Grafana sends them ------------------------------------------------------------------------------
def _regex_escape(value: str) -> str:
    return _REGEX_SPECIAL.sub(r"\\\\\1", value)


def _value_of(variable: Mapping[str, Any], given: str | None) -> str:
    """What Grafana's Prometheus data source puts in place of a variable: a multi-value or All variable becomes a
    regex (``(a|b)``; All: its ``allValue``), a single-value one its value with quotes and backslashes escaped."""
    multi = bool(variable.get("multi") or variable.get("includeAll"))
    name = variable.get("name")
    if given is None:
        if not variable.get("includeAll"):
            raise ValueError(f"no value given for variable {name!r}")
        given = "All"
    if not multi:
        return given.replace("\\", "\\\\").replace('"', '\\"')
    if given in ("All", "$__all") and variable.get("includeAll"):
        return str(variable.get("allValue") or ".*")
    values = [v for v in given.split(",") if v]
    if len(values) == 1:
        return _regex_escape(values[0])
    return "(" + "|".join(_regex_escape(v) for v in values) + ")"


def panel_queries(board: Mapping[str, Any], values: Mapping[str, str], interval: str = "1m") -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of every panel, with the variables substituted: ``values`` gives each
    variable's value (several values of a multi-value variable separated by commas; ``All``, or leaving an
    include-All variable out, selects all); ``$__rate_interval``, ``$__interval`` and ``$__range`` become
    ``interval``."""
    substitute = _substitution(board, values, interval)
    return [(str(p["title"]), substitute(str(t["expr"]))) for p, t in _targets(board)]


def variable_queries(board: Mapping[str, Any], values: Mapping[str, str]) -> list[tuple[str, str]]:
    """(variable name, query) for every query variable (``label_values(...)``), substituted as ``panel_queries``
    does."""
    substitute = _substitution(board, values, "1m")
    found = []
    for v in board.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            query = v.get("query")
            found.append((str(v["name"]), substitute(str(query.get("query") if isinstance(query, Mapping) else query))))
    return found


def _substitution(board: Mapping[str, Any], values: Mapping[str, str], interval: str) -> Callable[[str], str]:
    variables = {v["name"]: v for v in board.get("templating", {}).get("list", [])}
    unknown = set(values) - set(variables)
    if unknown:
        raise ValueError(f"{board.get('title')}: no variable {', '.join(sorted(unknown))}")

    def replace(m: re.Match[str]) -> str:
        ref = next(g for g in m.groups() if g)
        if ref in ("__rate_interval", "__interval", "__range"):
            return interval
        if ref not in variables:
            raise ValueError(f"{board.get('title')}: ${ref} is not a variable")
        return _value_of(variables[ref], values.get(ref))

    return lambda text: _REFERENCE.sub(replace, text)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m opsd.dashboards", description="opsd's Grafana dashboards.")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("write", help="write DIR/<name>.json for every dashboard").add_argument("dir", type=Path)
    sub.add_parser("check", help="exit 1 when DIR's files differ from the code").add_argument("dir", type=Path)
    args = p.parse_args(argv)
    problems = validate(list(build_all().values()))
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    if args.command == "write":
        for path in write(args.dir):
            print(path)
        return 0
    stale = check(args.dir)
    for name in stale:
        print(f"{name} differs from the code (python -m opsd.dashboards write {args.dir})", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
