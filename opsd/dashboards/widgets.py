"""The builders opsd's Grafana dashboards are made of: queries, panels of four kinds, the template variables, and the
dashboard that numbers and places its panels. Each is a thin layer over the typed builders of Grafana's foundation
SDK (``grafana-foundation-sdk``, generated from Grafana's own schemas, here Grafana 11.6's: dashboard schema
version 41), so that a field Grafana does not know, or a value of the wrong type, is a type error here."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, TypeVar

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.builders import heatmap as heatmap_builders
from grafana_foundation_sdk.builders import prometheus, timeseries
from grafana_foundation_sdk.builders import stat as stat_builders
from grafana_foundation_sdk.builders import table as table_builders
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as models
from grafana_foundation_sdk.models.heatmap import HeatmapColorMode, HeatmapColorScale
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

SCHEMA_VERSION = models.Dashboard().schema_version  # the SDK's Grafana's (41 for Grafana 11.6)
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_COLUMNS = 24  # Grafana's grid is 24 columns wide

RUN = 'run="$run"'
RANKS = 'run="$run", node=~"$node", rank=~"$rank"'
NODES = 'node=~"$node"'
GPU = "{{node}} GPU {{gpu}}"
Query = tuple[str, str]  # (PromQL, legend)
PanelBuilder = Builder[models.Panel]

# the panel kinds' builders share no base class: one type variable for the setters they all have
_Kind = TypeVar("_Kind", timeseries.Panel, stat_builders.Panel, table_builders.Panel, heatmap_builders.Panel)


def _datasource() -> models.DataSourceRef:
    return models.DataSourceRef(type_val=DATASOURCE["type"], uid=DATASOURCE["uid"])


# -- builders ----------------------------------------------------------------------------------------------------
def target(expr: str, legend: str = "", *, instant: bool = False) -> prometheus.Dataquery:
    """One PromQL query of a panel (``panel`` sets its refId)."""
    query = prometheus.Dataquery().datasource(_datasource()).expr(expr).legend_format(legend or "__auto")
    return query.instant().format(PromQueryFormat.TABLE) if instant else query.range()


def panel(
    builder: _Kind,
    title: str,
    queries: Sequence[prometheus.Dataquery],
    unit: str,
    *,
    about: str = "",
    width: int = 12,
    height: int = 8,
    lo: float | None = None,
    hi: float | None = None,
) -> _Kind:
    """The settings every panel has; ``dashboard`` numbers and places it."""
    if not 0 < width <= GRID_COLUMNS or height <= 0:
        raise ValueError(f"panel {title!r}: width must be 1-{GRID_COLUMNS} and height > 0, not {width}x{height}")
    builder = builder.title(title).description(about).datasource(_datasource()).unit(unit)
    builder = builder.grid_pos(models.GridPos(h=height, w=width, x=0, y=0))
    if lo is not None:
        builder = builder.min(lo)
    if hi is not None:
        builder = builder.max(hi)
    for i, query in enumerate(queries):
        builder = builder.with_target(query.ref_id(chr(ord("A") + i)))
    return builder


def ts(title: str, unit: str, *queries: Query, **kw: Any) -> timeseries.Panel:
    """A time series panel, a line per series of each query."""
    legend = common_builders.VizLegendOptions().display_mode(common.LegendDisplayMode.LIST)
    legend = legend.placement(common.LegendPlacement.BOTTOM).show_legend(True)
    tooltip = common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI)
    tooltip = tooltip.sort(common.SortOrder.DESCENDING)
    lines = timeseries.Panel().line_width(1).fill_opacity(10).show_points(common.VisibilityMode.NEVER)
    lines = lines.span_nulls(False).legend(legend).tooltip(tooltip)
    return panel(lines, title, [target(e, legend) for e, legend in queries], unit, **kw)


def stat(title: str, unit: str, query: Query, *, names: bool = False, **kw: Any) -> stat_builders.Panel:
    """A single value (the last one); ``names``: show the series' legend (a state's name) instead of the value."""
    reduce = common_builders.ReduceDataOptions().calcs(["lastNotNull"]).fields("").values(False)
    big = stat_builders.Panel().reduce_options(reduce)
    if names:
        big = big.color_mode(common.BigValueColorMode.NONE).graph_mode(common.BigValueGraphMode.NONE)
        big = big.text_mode(common.BigValueTextMode.NAME)
    else:
        big = big.color_mode(common.BigValueColorMode.VALUE).graph_mode(common.BigValueGraphMode.AREA)
        big = big.text_mode(common.BigValueTextMode.AUTO)
    return panel(big, title, [target(*query)], unit, **{"width": 6, "height": 4, **kw})


def table(title: str, expr: str, value: str, **kw: Any) -> table_builders.Panel:
    """A table of an instant query: a row per series, its labels as columns and its value as ``value``."""
    hidden = dict.fromkeys(["Time", "__name__", "job", "instance"], True)
    organize = {"excludeByName": hidden, "indexByName": {}, "renameByName": {"Value": value}}
    rows = table_builders.Panel().show_header(True).cell_height(common.TableCellHeight.SM)
    rows = rows.footer(common_builders.TableFooterOptions().show(False))
    rows = rows.with_transformation(models.DataTransformerConfig(id_val="organize", options=organize))
    return panel(rows, title, [target(expr, instant=True)], "none", **kw)


def heatmap(title: str, query: Query, **kw: Any) -> heatmap_builders.Panel:
    """A heatmap whose rows are the query's series, one per rank, in the order of their names (``calculate`` off:
    no bucketing; the rows' layout ``unknown``: the names are labels, not bucket bounds)."""
    colours = heatmap_builders.HeatmapColorOptions().mode(HeatmapColorMode.SCHEME).scheme("RdYlGn").reverse(True)
    colours = colours.steps(64).scale(HeatmapColorScale.LINEAR).fill("dark-orange").exponent(0.5)
    rows = heatmap_builders.RowsHeatmapOptions().layout(common.HeatmapCellLayout.UNKNOWN).value("value")
    cells = heatmap_builders.Panel().calculate(False).rows_frame(rows).color(colours).cell_gap(1)
    cells = cells.y_axis(heatmap_builders.YAxisConfig().axis_placement(common.AxisPlacement.LEFT))
    cells = cells.mode(common.TooltipDisplayMode.SINGLE).hide_y_histogram().show_legend()
    return panel(cells, title, [target(*query)], "none", **kw)


def query_variable(name: str, label: str, query: str, *, multi: bool) -> dashboard_builders.QueryVariable:
    """A variable whose values are a label's values in Prometheus (``label_values(series, label)``), refreshed on a
    time range change (a new run or node appears without a reload); a multi-value one has All (``.*``)."""
    v = dashboard_builders.QueryVariable(name).label(label).datasource(_datasource()).query(query).regex("")
    v = v.refresh(models.VariableRefresh.ON_TIME_RANGE_CHANGED).hide(models.VariableHide.DONT_HIDE)
    # ranks numerically, the rest alphabetically
    v = v.sort(models.VariableSort.NUMERICAL_ASC if name == "rank" else models.VariableSort.ALPHABETICAL_ASC)
    v = v.multi(multi).include_all(multi)
    return v.all_value(".*") if multi else v


def variables(*names: str) -> list[Builder[models.VariableModel]]:
    """``datasource`` and the named ones of ``run``, ``node``, ``rank`` (nodes and ranks of the chosen run)."""
    found: dict[str, Builder[models.VariableModel]] = {
        "datasource": dashboard_builders.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        "run": query_variable("run", "Run", "label_values(opsd_rank_info, run)", multi=False),
        "node": query_variable("node", "Node", 'label_values(opsd_rank_info{run="$run"}, node)', multi=True),
        "rank": query_variable(
            "rank", "Rank", 'label_values(opsd_rank_info{run="$run", node=~"$node"}, rank)', multi=True
        ),
    }
    return [found["datasource"], *(found[n] for n in names)]


def dashboard(
    uid: str,
    title: str,
    about: str,
    variables: list[Builder[models.VariableModel]],
    panels: Sequence[PanelBuilder],
    first_id: int,
) -> dict[str, Any]:
    """The dashboard in Grafana's JSON model: panels numbered from ``first_id`` (unique across opsd's dashboards)
    and placed left to right, top to bottom, on Grafana's 24-column grid."""
    link = dashboard_builders.DashboardLink("opsd").type(models.DashboardLinkType.DASHBOARDS).tags(["opsd"])
    link = link.as_dropdown(True).include_vars(True).keep_time(True).icon("external link").target_blank(False)
    board = dashboard_builders.Dashboard(title).uid(uid).description(about).tags(["opsd"]).editable()
    board = board.tooltip(models.DashboardCursorSync.CROSSHAIR).refresh("30s").version(1)
    board = board.time("now-6h", "now").timepicker(dashboard_builders.TimePicker()).timezone("browser")
    board = board.fiscal_year_start_month(0).live_now(False).variables(variables)
    board = board.link(link)  # the other opsd dashboards, with this one's time range and variables
    x = y = row_height = 0
    for i, p in enumerate(panels):
        grid = p.build().grid_pos
        assert grid is not None  # ``panel`` sets it
        if x + grid.w > GRID_COLUMNS:
            x, y, row_height = 0, y + row_height, 0
        board = board.with_panel(_placed(p, models.GridPos(h=grid.h, w=grid.w, x=x, y=y), first_id + i))
        x += grid.w
        row_height = max(row_height, grid.h)
    built: dict[str, Any] = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    return built


def _placed(builder: PanelBuilder, grid: models.GridPos, panel_id: int) -> PanelBuilder:
    """The panel ``builder`` builds, at ``grid`` with id ``panel_id``."""
    built = builder.build()
    built.grid_pos, built.id_val = grid, panel_id
    return builder
