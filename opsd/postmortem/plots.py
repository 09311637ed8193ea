"""The post-mortem's plots as PNG bytes (matplotlib's Agg canvas, no display, no pyplot state).

Each function takes parts of an ``opsd.postmortem.report.Report`` and returns the PNG, or None when there is nothing to
draw. Labels taken from the bundle are drawn as plain text (mathtext off), never interpreted.
"""

from __future__ import annotations

import functools
import io
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal, ParamSpec, TypeVar

from opsd.policy.goodput import BadputBucket

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from opsd.postmortem.model import Goodput, IncidentReport, Report, StragglerWarning

PHASE_COLOURS = {
    "detection": "#e67e22",
    "dump": "#8e44ad",
    "stop": "#c0392b",
    "cordon": "#7f8c8d",
    "swap": "#2980b9",
    "relaunch": "#16a085",
    "first step": "#27ae60",
}
OTHER_PHASE_COLOUR = "#95a5a6"
BADPUT_COLOURS: dict[str, str] = {
    BadputBucket.STARTUP: "#16a085",
    BadputBucket.CHECKPOINT: "#2980b9",
    BadputBucket.DETECTION: "#e67e22",
    BadputBucket.SPARE_WAIT: "#8e44ad",
    BadputBucket.RESTART: "#c0392b",
    BadputBucket.RECOMPUTE: "#f1c40f",
    BadputBucket.QUORUM: "#d35400",
}
DPI = 100
_P = ParamSpec("_P")
_R = TypeVar("_R")


def _plain(draw: Callable[_P, _R]) -> Callable[_P, _R]:
    @functools.wraps(draw)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        import matplotlib

        # labels taken from the bundle are drawn as they are: a "$" in a node name does not start mathtext
        with matplotlib.rc_context({"text.parse_math": False, "text.usetex": False}):
            return draw(*args, **kwargs)

    return wrapper


def _figure(width_in: float, height_in: float) -> tuple[Figure, Axes]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width_in, height_in), dpi=DPI)
    FigureCanvasAgg(figure)
    return figure, figure.subplots()


def _png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # labels too long for a tight layout: drawn as they are
        figure.tight_layout()
    figure.savefig(buffer, format="png", metadata={"Software": None})
    return buffer.getvalue()


def _over_run_time(
    figure: Figure, axes: Axes, unit: str, ylabel: str, title: str, *, legend: Literal["best", "lower right"]
) -> bytes:
    """A chart drawn against the run's time (in ``unit``), finished alike: its labels, a grid, a legend at
    ``legend``; as PNG."""
    axes.set_xlabel(f"{unit} since the run started")
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    axes.legend(loc=legend, fontsize=8)
    return _png(figure)


def _time_unit(span_s: float) -> tuple[float, str]:
    """(divisor, name) of the unit that suits a span of ``span_s`` seconds."""
    if span_s > 3 * 3600:
        return 3600.0, "hours"
    if span_s > 600:
        return 60.0, "minutes"
    return 1.0, "seconds"


@_plain
def timeline_png(incidents: Sequence[IncidentReport]) -> bytes | None:
    """Gantt bars of each recovery's phases in seconds after its failure: one row per phase for one incident, one
    row per incident (its phases side by side) for several."""
    drawn = [i for i in incidents if i.is_failure and i.timeline]
    if not drawn:
        return None
    single = len(drawn) == 1
    rows: list[tuple[str, list[tuple[str, float, float]]]] = []
    for i in drawn:
        bars = []
        for p in i.timeline:
            if p.name == "failure" or p.start_s is None:
                continue
            end = p.end_s if p.end_s is not None else i.downtime_s
            if end is None:
                continue
            bars.append((p.name, p.start_s, max(end - p.start_s, 0.0)))
        if single:
            rows += [(name, [(name, start, width)]) for name, start, width in bars]
        else:
            rows.append((f"#{i.id} {i.kind} on {i.node}", bars))
    figure, axes = _figure(10.5, 1.4 + 0.42 * max(len(rows), 2))
    seen: set[str] = set()
    for y, (_, bars) in enumerate(rows):
        for name, start, width in bars:
            colour = PHASE_COLOURS.get(name, OTHER_PHASE_COLOUR)
            label = None if name in seen else name
            seen.add(name)
            axes.barh(y, max(width, 0.05), left=start, height=0.6, color=colour, label=label, edgecolor="white")
    axes.axvline(0, color="#c0392b", linewidth=1.5, linestyle="--", label="failure")
    axes.set_yticks(range(len(rows)), [label for label, _ in rows])
    axes.invert_yaxis()
    axes.set_xlabel("seconds after the failure")
    title = f"Recovery of incident {drawn[0].id} ({drawn[0].kind} on {drawn[0].node})" if single else "Recoveries"
    axes.set_title(title)
    axes.grid(True, axis="x", alpha=0.3)
    if single:
        for y, (_, bars) in enumerate(rows):
            for _, start, width in bars:
                axes.annotate(f" {width:.1f} s", (start + width, y), va="center", fontsize=8)
    else:
        axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return _png(figure)


@_plain
def badput_png(goodput: Goodput) -> bytes | None:
    """Seconds lost per badput bucket, with the ETTR in the title."""
    if not goodput.badput_s:
        return None
    names = [name for name, _ in goodput.badput_s]
    values = [value for _, value in goodput.badput_s]
    figure, axes = _figure(8.0, 0.9 + 0.5 * len(names))
    colours = [BADPUT_COLOURS.get(name, OTHER_PHASE_COLOUR) for name in names]
    axes.barh(range(len(names)), values, color=colours)
    axes.set_yticks(range(len(names)), names)
    axes.invert_yaxis()
    top = max(values, default=0.0)
    for y, value in enumerate(values):
        axes.text(value + top * 0.01, y, f"{value:.1f} s", va="center", fontsize=9)
    axes.set_xlim(0, top * 1.15 if top > 0 else 1.0)
    axes.set_xlabel("seconds")
    ettr = f" (ETTR {goodput.ettr:.3f})" if goodput.ettr is not None else ""
    axes.set_title("Badput by bucket" + ettr)
    axes.grid(True, axis="x", alpha=0.3)
    return _png(figure)


@_plain
def stragglers_png(
    warnings: Sequence[StragglerWarning], origin_unix_s: float | None, end_unix_s: float | None = None
) -> bytes | None:
    """The slowdown ratio of each rank warned about, over the run's time (from ``origin_unix_s`` to
    ``end_unix_s`` when known)."""
    points = [w for w in warnings if w.time_unix_s is not None and w.slowdown_ratio is not None]
    if not points:
        return None
    origin = origin_unix_s if origin_unix_s is not None else min(w.time_unix_s for w in points if w.time_unix_s)
    times = [float(w.time_unix_s or 0.0) - origin for w in points]
    end = max(times) if end_unix_s is None else max(max(times), end_unix_s - origin)
    divisor, unit = _time_unit(end - min(min(times), 0.0))
    figure, axes = _figure(9.0, 3.6)
    for rank in sorted({w.rank for w in points}, key=lambda r: -1 if r is None else r):
        mine = [(t / divisor, w) for t, w in zip(times, points, strict=True) if w.rank == rank]
        xs = [t for t, _ in mine]
        ys = [float(w.slowdown_ratio or 0.0) for _, w in mine]
        axes.plot(xs, ys, marker="o", markersize=7, linewidth=1.5, label=f"rank {rank} ({mine[0][1].node})")
        for x, y in zip(xs, ys, strict=True):
            axes.annotate(f" {y:.2f}x", (x, y), va="bottom", fontsize=8)
    axes.set_xlim(min(min(times), 0.0) / divisor, end / divisor * 1.02 if end > 0 else 1.0)
    axes.set_ylim(0.95, max(float(w.slowdown_ratio or 1.0) for w in points) * 1.08)
    axes.axhline(1.0, color="#7f8c8d", linewidth=1, linestyle="--", label="median rank")
    return _over_run_time(figure, axes, unit, "slowdown (x median)", "Straggler warnings", legend="best")


@_plain
def checkpoints_png(report: Report) -> bytes | None:
    """Checkpoint steps against time: committed ones as dots, torn ones as red crosses (a dashed line at their step
    when their time is unknown), the ones resumed from ringed, failures as vertical lines."""
    if not report.checkpoints:
        return None
    times = [c.time_unix_s for c in report.checkpoints if c.time_unix_s is not None]
    times += [i.failed_unix_s for i in report.incidents if i.is_failure and i.failed_unix_s is not None]
    origin = report.created_unix_s if report.created_unix_s is not None else min(times, default=0.0)
    span = max((t - origin for t in times), default=1.0)
    divisor, unit = _time_unit(span)
    figure, axes = _figure(9.0, 4.0)
    committed = [c for c in report.checkpoints if c.state == "committed" and c.time_unix_s is not None]
    axes.plot(
        [(float(c.time_unix_s or 0.0) - origin) / divisor for c in committed],
        [c.step for c in committed],
        marker="o",
        linestyle="-",
        color="#2980b9",
        label="committed",
    )
    torn = [c for c in report.checkpoints if c.state != "committed"]
    timed = [c for c in torn if c.time_unix_s is not None]
    if timed:
        xs = [(float(c.time_unix_s or 0.0) - origin) / divisor for c in timed]
        axes.plot(xs, [c.step for c in timed], "x", color="#c0392b", markersize=11, mew=2.5, label="torn")
    for n, c in enumerate(c for c in torn if c.time_unix_s is None):
        axes.axhline(
            c.step, color="#c0392b", linestyle=":", linewidth=1.5, label="torn (time unknown)" if not n else None
        )
        axes.annotate(
            f"step {c.step} {c.state}", (0.01, c.step), xycoords=("axes fraction", "data"), va="bottom", color="#c0392b"
        )
    resumed = {i.resume.step for i in report.incidents if i.resume.step}
    ringed = [c for c in committed if c.step in resumed]
    if ringed:
        axes.plot(
            [(float(c.time_unix_s or 0.0) - origin) / divisor for c in ringed],
            [c.step for c in ringed],
            "o",
            markersize=15,
            markerfacecolor="none",
            markeredgecolor="#27ae60",
            mew=2.5,
            label="resumed from",
        )
    for n, i in enumerate(i for i in report.incidents if i.is_failure and i.failed_unix_s is not None):
        x = (float(i.failed_unix_s or 0.0) - origin) / divisor
        axes.axvline(x, color="#e67e22", linestyle="--", linewidth=1.2, label="failure" if not n else None)
        axes.annotate(f"#{i.id}", (x, 0.98), xycoords=("data", "axes fraction"), ha="left", va="top", fontsize=8)
    return _over_run_time(figure, axes, unit, "step", "Checkpoints", legend="lower right")
