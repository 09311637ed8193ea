"""The builders opsd's Grafana dashboards are made of (Grafana's JSON model, schema version 39): queries, panels
of four kinds, the template variables, and the dashboard that numbers and places its panels."""

from __future__ import annotations

from typing import Any

SCHEMA_VERSION = 39
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

RUN = 'run="$run"'
RANKS = 'run="$run", node=~"$node", rank=~"$rank"'
NODES = 'node=~"$node"'
GPU = "{{node}} GPU {{gpu}}"
Query = tuple[str, str]  # (PromQL, legend)


# -- builders ----------------------------------------------------------------------------------------------------
def target(expr: str, legend: str = "", *, instant: bool = False) -> dict[str, Any]:
    """One PromQL query of a panel (``panel`` sets its refId)."""
    t: dict[str, Any] = {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend or "__auto"}
    t.update({"instant": True, "range": False, "format": "table"} if instant else {"range": True, "instant": False})
    return t


def panel(
    kind: str,
    title: str,
    targets: list[dict[str, Any]],
    unit: str,
    options: dict[str, Any],
    *,
    about: str = "",
    width: int = 12,
    height: int = 8,
    lo: float | None = None,
    hi: float | None = None,
) -> dict[str, Any]:
    """A panel; ``dashboard`` numbers and places it."""
    defaults: dict[str, Any] = {"unit": unit}
    defaults.update({k: v for k, v in (("min", lo), ("max", hi)) if v is not None})
    if kind == "timeseries":
        defaults["custom"] = {"lineWidth": 1, "fillOpacity": 10, "showPoints": "never", "spanNulls": False}
    return {
        "type": kind,
        "title": title,
        "description": about,
        "datasource": DATASOURCE,
        "gridPos": {"h": height, "w": width, "x": 0, "y": 0},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options,
        "targets": [{**t, "refId": chr(ord("A") + i)} for i, t in enumerate(targets)],
    }


def ts(title: str, unit: str, *queries: Query, **kw: Any) -> dict[str, Any]:
    """A time series panel, a line per series of each query."""
    options = {
        "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
        "tooltip": {"mode": "multi", "sort": "desc"},
    }
    return panel("timeseries", title, [target(e, legend) for e, legend in queries], unit, options, **kw)


def stat(title: str, unit: str, query: Query, *, names: bool = False, **kw: Any) -> dict[str, Any]:
    """A single value (the last one); ``names``: show the series' legend (a state's name) instead of the value."""
    options = {
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        "colorMode": "none" if names else "value",
        "graphMode": "none" if names else "area",
        "textMode": "name" if names else "auto",
    }
    return panel("stat", title, [target(*query)], unit, options, **{"width": 6, "height": 4, **kw})


def table(title: str, expr: str, value: str, **kw: Any) -> dict[str, Any]:
    """A table of an instant query: a row per series, its labels as columns and its value as ``value``."""
    options = {"showHeader": True, "cellHeight": "sm", "footer": {"show": False}}
    hidden = dict.fromkeys(["Time", "__name__", "job", "instance"], True)
    organize = {"excludeByName": hidden, "indexByName": {}, "renameByName": {"Value": value}}
    return panel("table", title, [target(expr, instant=True)], "none", options, **kw) | {
        "transformations": [{"id": "organize", "options": organize}]
    }


def heatmap(title: str, query: Query, **kw: Any) -> dict[str, Any]:
    """A heatmap whose rows are the query's series (no bucketing: ``calculate`` off)."""
    options = {
        "calculate": False,
        "yAxis": {"axisPlacement": "left"},
        "color": {"mode": "scheme", "scheme": "RdYlGn", "reverse": True, "steps": 64},
        "cellGap": 1,
        "tooltip": {"mode": "single", "yHistogram": False},
        "legend": {"show": True},
    }
    return panel("heatmap", title, [target(*query)], "none", options, **kw)


def query_variable(name: str, label: str, query: str, *, multi: bool) -> dict[str, Any]:
    """A variable whose values are a label's values in Prometheus (``label_values(series, label)``); a multi-value
    one has All (``.*``)."""
    v: dict[str, Any] = {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": query,  # the string form: every Grafana version reads it (newer ones migrate it on load)
        "definition": query,
        "refresh": 2,  # on time range change: a new run or node appears without a reload
        "sort": 3 if name == "rank" else 1,  # ranks numerically, the rest alphabetically
        "regex": "",
        "hide": 0,
        "multi": multi,
        "includeAll": multi,
        "current": {},
        "options": [],
    }
    if multi:
        v["allValue"] = ".*"
    return v


def variables(*names: str) -> list[dict[str, Any]]:
    """``datasource`` and the named ones of ``run``, ``node``, ``rank`` (nodes and ranks of the chosen run)."""
    found = {
        "datasource": {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus"}
        | {"regex": "", "hide": 0, "multi": False, "includeAll": False, "current": {}, "options": []},
        "run": query_variable("run", "Run", "label_values(opsd_rank_info, run)", multi=False),
        "node": query_variable("node", "Node", 'label_values(opsd_rank_info{run="$run"}, node)', multi=True),
        "rank": query_variable(
            "rank", "Rank", 'label_values(opsd_rank_info{run="$run", node=~"$node"}, rank)', multi=True
        ),
    }
    return [found["datasource"], *(found[n] for n in names)]


def dashboard(
    uid: str, title: str, about: str, variables: list[dict[str, Any]], panels: list[dict[str, Any]], first_id: int
) -> dict[str, Any]:
    """The dashboard: panels numbered from ``first_id`` (unique across opsd's dashboards) and placed left to right,
    top to bottom, on Grafana's 24-column grid."""
    x = y = row_height = 0
    for i, p in enumerate(panels):
        grid = p["gridPos"]
        if x + grid["w"] > 24:
            x, y, row_height = 0, y + row_height, 0
        grid["x"], grid["y"] = x, y
        x += grid["w"]
        row_height = max(row_height, grid["h"])
        p["id"] = first_id + i
    link = {"title": "opsd", "type": "dashboards", "tags": ["opsd"], "asDropdown": True, "includeVars": True}
    link |= {"keepTime": True, "icon": "external link", "targetBlank": False, "tooltip": "", "url": ""}
    return {
        "uid": uid,
        "title": title,
        "description": about,
        "tags": ["opsd"],
        "editable": True,
        "graphTooltip": 1,  # shared crosshair
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "time": {"from": "now-6h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "weekStart": "",
        "annotations": {"list": []},
        "links": [link],  # the other opsd dashboards, with this one's time range and variables
        "templating": {"list": variables},
        "panels": panels,
    }
