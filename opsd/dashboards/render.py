"""A dashboard drawn as a PNG from what its panels' queries return from a Prometheus: each panel in its place on
Grafana's grid (``gridPos``), time series as lines, stats as their last value, tables as rows, heatmaps as a row
per series, with the panel's legends, unit and axis limits. It shows what Grafana would, without a Grafana.

``python -m opsd.dashboards.render --prometheus URL --run RUN --start S --end E --out DIR [NAME ...]`` writes
``DIR/dashboard-<name>.png``; ``render_dashboard`` gives the PNG and what each panel drew (matplotlib's Agg canvas,
no display, no pyplot state; labels are drawn as plain text, never as mathtext).
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import math
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opsd.dashboards.build import panel_queries
from opsd.errors import ConfigError, OpsError, PermanentError, TransientError

if TYPE_CHECKING:
    from matplotlib.axes import Axes

log = logging.getLogger(__name__)

_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")
_HIDDEN_COLUMNS = ("Time", "__name__", "job", "instance")
ROW_HEIGHT_IN = 0.3  # a grid unit is 30 px high; at 16 in wide a column is ~0.67 in
MAX_LEGEND_ENTRIES = 8
TITLE_IN = 0.5  # the dashboard's title, above the grid
PANEL_TITLE_IN = 0.22  # a panel's title, above its axes
AXIS_LABELS_IN = 0.7  # a graph's value labels, left of its axes


@dataclass(frozen=True)
class RenderConfig:
    """What to draw: the run, the time span (Unix seconds), the query step, what ``$__rate_interval`` stands for,
    and the picture's width and resolution."""

    run: str
    start_s: float
    end_s: float
    step_s: float = 5.0
    rate_interval: str = "1m"
    width_in: float = 16.0
    dpi: int = 72

    def __post_init__(self) -> None:
        if not self.run:
            raise ConfigError("render.run must not be empty")
        if not self.end_s > self.start_s:
            raise ConfigError("render.end_s must be after render.start_s")
        if self.step_s <= 0:
            raise ConfigError("render.step_s must be > 0")
        if self.width_in <= 0 or self.dpi <= 0:
            raise ConfigError("render.width_in and render.dpi must be > 0")


@dataclass(frozen=True)
class Series:
    labels: Mapping[str, str]
    times_s: tuple[float, ...]
    values: tuple[float, ...]


class PrometheusReader:
    """Prometheus' HTTP query API (``/api/v1/query_range``): a query's series over a time span."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"the Prometheus URL must be http(s)://HOST[:PORT][/PREFIX], not {url!r}")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def query_range(self, expr: str, start_s: float, end_s: float, step_s: float) -> list[Series]:
        params = urllib.parse.urlencode({"query": expr, "start": start_s, "end": end_s, "step": step_s})
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/query_range?{params}", timeout=self.timeout_s) as r:
                body = json.load(r)
        except urllib.error.HTTPError as exc:  # a bad query: 400 with the reason in the body
            body = json.loads(exc.read() or b"{}")
        except OSError as exc:
            raise TransientError(f"cannot reach Prometheus at {self.url}: {exc}") from exc
        if body.get("status") != "success":
            raise PermanentError(f"Prometheus refused {expr!r}: {body.get('error', body)}")
        return [
            Series(
                labels=s.get("metric", {}),
                times_s=tuple(float(t) for t, _ in s["values"]),
                values=tuple(float(v) for _, v in s["values"]),
            )
            for s in body["data"]["result"]
        ]


@dataclass(frozen=True)
class PanelPicture:
    """What one panel drew: its title, kind, the series its queries returned and their points."""

    title: str
    kind: str
    series: int
    points: int


@dataclass(frozen=True)
class Picture:
    png: bytes
    panels: tuple[PanelPicture, ...]


def legend(template: str, labels: Mapping[str, str]) -> str:
    """A series' name as Grafana's legend format makes it (``{{label}}`` replaced; ``__auto``: the labels)."""
    if template in ("", "__auto"):
        shown = {k: v for k, v in labels.items() if k != "__name__"}
        return labels.get("__name__", "") + "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(shown.items())) + "}"
    return _LEGEND.sub(lambda m: labels.get(m.group(1), ""), template)


def render_dashboard(board: Mapping[str, Any], reader: PrometheusReader, config: RenderConfig) -> Picture:
    """The dashboard's PNG and what each panel drew, from ``reader`` over ``config``'s time span."""
    from matplotlib import rc_context

    with rc_context({"text.parse_math": False, "text.usetex": False, "font.size": 8}):
        return _render(board, reader, config)


def _render(board: Mapping[str, Any], reader: PrometheusReader, config: RenderConfig) -> Picture:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = list(board.get("panels", []))
    exprs = iter(expr for _, expr in panel_queries(board, {"run": config.run}, interval=config.rate_interval))
    rows = max((p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels), default=1)
    height_in = TITLE_IN + rows * ROW_HEIGHT_IN
    fig = Figure(figsize=(config.width_in, height_in), dpi=config.dpi)
    FigureCanvasAgg(fig)
    fig.suptitle(f"{board.get('title')}  (run {config.run})", fontsize=12, fontweight="bold", y=1 - 0.1 / height_in)
    drawn = []
    for p in panels:
        ax = fig.add_axes(_place(p["gridPos"], str(p.get("type")), config.width_in, height_in))
        queries = [(next(exprs), t.get("legendFormat", "")) for t in p.get("targets", [])]
        found = [(s, legend(template, s.labels)) for expr, template in queries for s in _query(reader, expr, config)]
        drawn.append(_draw_panel(ax, p, found, config))
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=config.dpi)
    log.info("rendered %s: %d panels, %d with data", board.get("uid"), len(drawn), sum(d.points > 0 for d in drawn))
    return Picture(buffer.getvalue(), tuple(drawn))


def _place(grid: Mapping[str, int], kind: str, width_in: float, height_in: float) -> tuple[float, float, float, float]:
    """The panel's axes (left, bottom, width, height; figure fractions) inside its cell of the 24-column grid, with
    room for its title and, for a graph, its axes' tick labels."""
    left_in, bottom_in = (0.1, 0.1) if kind in ("stat", "table") else (AXIS_LABELS_IN, 0.3)
    x_in = grid["x"] / 24 * width_in + left_in
    w_in = grid["w"] / 24 * width_in - left_in - 0.1
    top_in = TITLE_IN + grid["y"] * ROW_HEIGHT_IN + PANEL_TITLE_IN
    h_in = grid["h"] * ROW_HEIGHT_IN - PANEL_TITLE_IN - bottom_in
    return (x_in / width_in, 1 - (top_in + h_in) / height_in, w_in / width_in, h_in / height_in)


def _query(reader: PrometheusReader, expr: str, config: RenderConfig) -> list[Series]:
    return reader.query_range(expr, config.start_s, config.end_s, config.step_s)


def _draw_panel(
    ax: Axes, panel: Mapping[str, Any], found: list[tuple[Series, str]], config: RenderConfig
) -> PanelPicture:
    kind = str(panel.get("type"))
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    unit = str(defaults.get("unit", "none"))
    ax.set_title(str(panel.get("title")), fontsize=8, loc="left")
    points = sum(len(s.values) for s, _ in found)
    if not points:
        _blank(ax, "No data")
    elif kind == "stat":
        _stat(ax, found, unit, names=panel.get("options", {}).get("textMode") == "name")
    elif kind == "table":
        _table(ax, found, panel)
    elif kind == "heatmap":
        _heatmap(ax, found, config)
    else:
        _lines(ax, found, unit, defaults.get("min"), defaults.get("max"), config)
    return PanelPicture(str(panel.get("title")), kind, len(found), points)


def _blank(ax: Axes, text: str, size: float = 9) -> None:
    ax.set_xticks([])
    ax.set_yticks([])
    ax.text(0.5, 0.45, text, ha="center", va="center", fontsize=size, transform=ax.transAxes)


def _lines(ax: Axes, found: list[tuple[Series, str]], unit: str, lo: Any, hi: Any, config: RenderConfig) -> None:
    from matplotlib.dates import DateFormatter

    for series, name in found:
        ax.plot([_when(t) for t in series.times_s], series.values, linewidth=1, label=name)
    ax.set_xlim(_when(config.start_s), _when(config.end_s))
    ax.xaxis.set_major_formatter(DateFormatter(_time_format(config)))
    ax.set_ylim(bottom=lo, top=hi)
    ax.yaxis.set_major_formatter(lambda v, _pos: format_value(v, unit))
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[:MAX_LEGEND_ENTRIES], labels[:MAX_LEGEND_ENTRIES], fontsize=6, loc="upper left", ncols=2)


def _stat(ax: Axes, found: list[tuple[Series, str]], unit: str, *, names: bool) -> None:
    newest_s = max(s.times_s[-1] for s, _ in found if s.times_s)
    last = [(s.values[-1], name) for s, name in found if s.values and s.times_s[-1] == newest_s]
    text = ", ".join(name for _, name in last) if names else format_value(last[0][0], unit)
    _blank(ax, text, size=16)


def _table(ax: Axes, found: list[tuple[Series, str]], panel: Mapping[str, Any]) -> None:
    renames = {"Value": "Value"}
    for t in panel.get("transformations", []):
        renames.update(t.get("options", {}).get("renameByName", {}))
    columns = sorted({k for s, _ in found for k in s.labels if k not in _HIDDEN_COLUMNS})
    cells = [[s.labels.get(c, "") for c in columns] + [f"{s.values[-1]:.3g}"] for s, _ in found if s.values]
    ax.axis("off")
    drawn = ax.table(cellText=cells[:8], colLabels=[*columns, renames["Value"]], loc="upper center")
    drawn.auto_set_font_size(False)
    drawn.set_fontsize(7)


def _heatmap(ax: Axes, found: list[tuple[Series, str]], config: RenderConfig) -> None:
    from matplotlib.dates import DateFormatter

    rows = sorted(found, key=lambda f: f[1])
    steps = max(1, math.floor((config.end_s - config.start_s) / config.step_s) + 1)
    cells = [[math.nan] * steps for _ in rows]
    for r, (series, _) in enumerate(rows):
        for t, v in zip(series.times_s, series.values, strict=True):
            column = round((t - config.start_s) / config.step_s)
            if 0 <= column < steps:
                cells[r][column] = v
    extent = (_when(config.start_s), _when(config.end_s), len(rows) - 0.5, -0.5)
    image = ax.imshow(cells, aspect="auto", cmap="RdYlGn_r", interpolation="nearest", extent=extent)
    ax.set_yticks(range(len(rows)), [name for _, name in rows], fontsize=7)
    ax.xaxis.set_major_formatter(DateFormatter(_time_format(config)))
    ax.tick_params(labelsize=7)
    ax.figure.colorbar(image, ax=ax, pad=0.01, fraction=0.03)


def _time_format(config: RenderConfig) -> str:
    """Seconds on the time axis of a span shorter than 10 minutes, as Grafana shows them."""
    return "%H:%M:%S" if config.end_s - config.start_s < 600 else "%H:%M"


def _when(t_s: float) -> float:
    """Unix seconds as matplotlib's dates (days since its epoch, UTC)."""
    from matplotlib.dates import date2num

    return float(date2num(datetime.fromtimestamp(t_s, tz=UTC)))


def format_value(value: float, unit: str) -> str:
    """``value`` as Grafana shows it in ``unit`` (the units opsd's panels use; any other: the number)."""
    if math.isnan(value):
        return "NaN"
    if unit == "percentunit":
        return f"{value * 100:.3g}%"
    if unit == "s":
        return f"{value * 1000:.3g} ms" if 0 < abs(value) < 1 else f"{value:.3g} s"
    if unit == "celsius":
        return f"{value:.3g} °C"
    if unit not in _SCALED:
        return f"{value:.4g}"
    suffix, base, prefixes = _SCALED[unit]
    i = 0
    while abs(value) >= base and i < len(prefixes) - 1:
        value, i = value / base, i + 1
    return f"{value:.3g} {prefixes[i]}{suffix}".rstrip()


_SI = ("", "k", "M", "G", "T")
_SCALED = {
    "short": ("", 1000, _SI),
    "bytes": ("B", 1024, ("", "Ki", "Mi", "Gi", "Ti")),
    "Bps": ("B/s", 1000, _SI),
    "hertz": ("Hz", 1000, _SI),
    "watt": ("W", 1000, _SI),
    "ops": ("ops/s", 1000, _SI),
}


def render_all(
    boards: Mapping[str, Mapping[str, Any]], reader: PrometheusReader, config: RenderConfig, names: Sequence[str]
) -> dict[str, Picture]:
    """The pictures of the dashboards ``names`` (file names without ``.json``)."""
    unknown = set(names) - set(boards)
    if unknown:
        raise ConfigError(f"no dashboard {', '.join(sorted(unknown))} (there are: {', '.join(boards)})")
    return {name: render_dashboard(boards[name], reader, config) for name in names}


def main(argv: Sequence[str] | None = None) -> int:
    from opsd.dashboards.build import build_all

    p = argparse.ArgumentParser(
        prog="python -m opsd.dashboards.render", description="Draw opsd's dashboards as PNGs from a Prometheus."
    )
    p.add_argument("--prometheus", required=True, help="Prometheus' URL, e.g. http://127.0.0.1:9090")
    p.add_argument("--run", required=True, help="the run (the dashboards' run variable)")
    p.add_argument("--start", type=float, required=True, help="Unix seconds")
    p.add_argument("--end", type=float, required=True, help="Unix seconds")
    p.add_argument("--step-s", type=float, default=5.0)
    p.add_argument("--rate-interval", default="1m", help="what $__rate_interval stands for")
    p.add_argument("--out", type=Path, required=True, help="directory for dashboard-<name>.png")
    p.add_argument("names", nargs="*", help="dashboards by file name (default: all)")
    args = p.parse_args(argv)
    boards = build_all()
    try:
        config = RenderConfig(args.run, args.start, args.end, args.step_s, args.rate_interval)
        pictures = render_all(boards, PrometheusReader(args.prometheus), config, args.names or list(boards))
    except OpsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    for name, picture in pictures.items():
        path = args.out / f"dashboard-{name}.png"
        path.write_bytes(picture.png)
        empty = [p.title for p in picture.panels if not p.points]
        print(f"{path}: {len(picture.panels)} panels" + (f", no data: {'; '.join(empty)}" if empty else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
