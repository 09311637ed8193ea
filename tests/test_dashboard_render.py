"""The dashboards drawn as PNGs (``opsd.dashboards.render``) from a real Prometheus holding ten minutes of a small
run's series (written into its TSDB with ``promtool tsdb create-blocks-from openmetrics`` before it starts): every
panel of Training and Stragglers is drawn in its grid place with the data its queries return."""

from __future__ import annotations

import io
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from opsd.dashboards.build import build_all
from opsd.dashboards.render import (
    ROW_HEIGHT_IN,
    TITLE_IN,
    PrometheusReader,
    RenderConfig,
    format_value,
    legend,
    main,
    render_dashboard,
)
from opsd.errors import ConfigError, PermanentError
from tests.prometheus import PrometheusServer

RUN = "llama-small"
RANKS = [("node-0", "0"), ("node-0", "1"), ("node-1", "2"), ("node-1", "3")]
SPAN_S = 600
STEP_S = 15


def openmetrics(end_s: int) -> str:
    """Ten minutes of a 4-rank run (two pipeline stages of two ranks), a sample every 15 s; rank 3 computes 30%
    slower and is flagged."""
    families: dict[str, list[str]] = {}  # OpenMetrics wants each metric's samples together
    times = range(end_s - SPAN_S, end_s + 1, STEP_S)

    def series(name: str, labels: str, value: float | int, t: int) -> None:
        families.setdefault(name, []).append(f"{name}{{{labels.replace(', ', ',')}}} {value} {t}")

    for i, t in enumerate(times):
        run = f'run="{RUN}"'
        series("opsd_run_mfu_ratio", run, 0.41 + 0.01 * (i % 3), t)
        series("opsd_run_tokens_per_second", run, 52000 + 100 * i, t)
        series("opsd_run_step", run, 10 * i, t)
        series("opsd_run_state", f'{run}, state="running"', 1, t)
        series("opsd_run_stragglers", run, 1, t)
        series("opsd_run_pipeline_bubble_ratio", run, 0.2, t)
        series("opsd_pipeline_bubble_theoretical_ratio", run, 0.2, t)
        for node, rank in RANKS:
            labels = f'{run}, node="{node}", rank="{rank}"'
            slow = 1.3 if rank == "3" else 1.0
            series("opsd_mfu_ratio", labels, round(0.42 / slow, 4), t)
            series("opsd_tokens_per_second", labels, 13000, t)
            series("opsd_step_seconds", labels, round(0.5 * slow, 3), t)
            series("opsd_step_compute_seconds", labels, round(0.4 * slow, 3), t)
            series("opsd_step_exposed_comm_seconds", labels, 0.1, t)
            series("opsd_loss", labels, round(6.0 - 0.05 * i, 3), t)
            series("opsd_pipeline_bubble_ratio", labels, 0.2 if rank != "3" else 0.1, t)
            series("opsd_steps_total", labels, 10 * i, t)
            series("opsd_memory_bytes", f'{labels}, kind="rss"', 2_000_000_000, t)
            if rank == "3":
                series("opsd_run_straggler_slowdown_ratio", labels, 1.3, t)
    return "".join(line + "\n" for lines in families.values() for line in lines) + "# EOF\n"


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PrometheusServer, int]]:
    workdir = tmp_path_factory.mktemp("render")
    end_s = int(time.time()) - 60
    source = workdir / "run.om"
    source.write_text(openmetrics(end_s))
    promtool = shutil.which("promtool")
    assert promtool is not None, "promtool is not installed (make test installs Debian's prometheus)"
    made = subprocess.run(
        [promtool, "tsdb", "create-blocks-from", "openmetrics", str(source), str(workdir / "tsdb")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stdout + made.stderr
    with PrometheusServer(workdir, targets=[]) as prom:
        yield prom, end_s


def config(end_s: int) -> RenderConfig:
    return RenderConfig(RUN, end_s - SPAN_S, end_s, step_s=STEP_S, rate_interval="1m", width_in=12, dpi=50)


@pytest.mark.parametrize("name", ["training", "stragglers"])
def test_every_panel_is_drawn_in_its_place_with_the_data_its_queries_return(
    prometheus: tuple[PrometheusServer, int], name: str
) -> None:
    from matplotlib.image import imread

    prom, end_s = prometheus
    board = build_all()[name]
    picture = render_dashboard(board, PrometheusReader(f"http://127.0.0.1:{prom.port}"), config(end_s))
    assert [p.title for p in picture.panels] == [p["title"] for p in board["panels"]]
    assert [p.kind for p in picture.panels] == [p["type"] for p in board["panels"]]
    empty = [p.title for p in picture.panels if not p.series or not p.points]
    assert not empty, f"panels without data: {empty}"
    image = imread(io.BytesIO(picture.png), format="png")
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in board["panels"])
    assert image.shape[1] == 12 * 50
    assert image.shape[0] == round((TITLE_IN + rows * ROW_HEIGHT_IN) * 50)
    assert image[..., :3].std() > 0.05  # not a blank canvas
    if name == "stragglers":
        heatmap = next(p for p in picture.panels if p.kind == "heatmap")
        assert heatmap.series == len(RANKS)  # a row per rank
        flagged = next(p for p in picture.panels if p.kind == "table")
        assert flagged.series == 1  # rank 3 only


def test_an_empty_panel_says_no_data_and_a_bad_query_or_prometheus_is_an_error(
    prometheus: tuple[PrometheusServer, int], tmp_path: Path
) -> None:
    prom, end_s = prometheus
    reader = PrometheusReader(f"http://127.0.0.1:{prom.port}")
    other_run = RenderConfig("no-such-run", end_s - SPAN_S, end_s, step_s=STEP_S, width_in=8, dpi=30)
    board = build_all()["reliability"]
    picture = render_dashboard({**board, "panels": board["panels"][:2]}, reader, other_run)
    assert [(p.series, p.points) for p in picture.panels] == [(0, 0), (0, 0)]
    with pytest.raises(PermanentError, match="parse error"):
        reader.query_range("opsd_loss{", end_s - 60, end_s, 15)
    with pytest.raises(ConfigError):
        PrometheusReader("127.0.0.1:9090")
    with pytest.raises(ConfigError, match="end_s"):
        RenderConfig(RUN, 10, 5)

    url = f"http://127.0.0.1:{prom.port}"
    args = ["--prometheus", url, "--run", RUN, "--start", str(end_s - SPAN_S), "--end", str(end_s)]
    assert main([*args, "--step-s", "60", "--out", str(tmp_path), "stragglers"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["dashboard-stragglers.png"]
    assert main([*args, "--out", str(tmp_path), "nosuch"]) == 1


@pytest.mark.parametrize(
    ("value", "unit", "shown"),
    [
        (0.4123, "percentunit", "41.2%"),
        (0.25, "s", "250 ms"),
        (12.5, "s", "12.5 s"),
        (2_000_000_000, "bytes", "1.86 GiB"),
        (52300, "short", "52.3 k"),
        (1.5e9, "hertz", "1.5 GHz"),
        (3, "none", "3"),
        (float("nan"), "s", "NaN"),
    ],
)
def test_values_are_shown_in_the_panels_unit(value: float, unit: str, shown: str) -> None:
    assert format_value(value, unit) == shown


def test_legends_are_made_as_grafana_makes_them() -> None:
    labels = {"__name__": "opsd_loss", "rank": "3", "node": "node-1"}
    assert legend("rank {{rank}} ({{ node }})", labels) == "rank 3 (node-1)"
    assert legend("__auto", labels) == 'opsd_loss{node="node-1", rank="3"}'
