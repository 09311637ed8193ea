"""The dashboards against Grafana's own dashboard model (``opsd.dashboards.schema``, over the models of Grafana's
foundation SDK): the generated and the committed dashboards have no field Grafana's model lacks and no value of
another type than it declares, and a dashboard broken in any such way fails ``validate`` with the path of the
fault."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest

from opsd.dashboards import build as dashboards
from opsd.dashboards.panels import BUILDERS
from opsd.dashboards.schema import schema_problems
from tests.launch import ROOT

Board = dict[str, Any]


def _panel(board: Board, kind: str) -> dict[str, Any]:
    panel: dict[str, Any] = next(p for p in board["panels"] if p["type"] == kind)
    return panel


def test_the_generated_and_the_committed_dashboards_fit_grafanas_model() -> None:
    built = dashboards.build_all()
    for name, board in built.items():
        assert schema_problems(board) == [], name
        committed = json.loads((ROOT / "dashboards" / f"{name}.json").read_text())
        assert schema_problems(committed) == [], name
    kinds = {p["type"] for board in built.values() for p in board["panels"]}
    assert kinds == {"timeseries", "stat", "heatmap", "table"}


def _set(path: str, value: Any) -> Callable[[Board], None]:
    """A change that sets ``path`` (``panels.0.gridPos.w``; a panel kind instead of an index: its first panel)."""

    def change(board: Board) -> None:
        *parents, last = path.split(".")
        node: Any = board
        for key in parents:
            if key.isdigit():
                node = node[int(key)]
            elif isinstance(node, list):
                node = next(p for p in node if p["type"] == key)
            else:
                node = node[key]
        node[last] = value

    return change


# (name, dashboard, change, the problem it must give)
BROKEN: list[tuple[str, str, Callable[[Board], None], str]] = [
    ("a top-level field Grafana does not know", "training", _set("owner", "ml-infra"), "owner: a field"),
    ("a string gridPos.w", "training", _set("panels.0.gridPos.w", "12"), 'panels[0].gridPos.w: "12" is not an integer'),
    ("a gridPos that is not an object", "training", _set("panels.0.gridPos", "wide"), "not readable"),
    (
        "a heatmap colour mode Grafana does not have",
        "stragglers",
        _set("panels.heatmap.options.color.mode", "rainbow"),
        "panels[0].options.color.mode: \"rainbow\" is none of 'opacity', 'scheme'",
    ),
    (
        "a heatmap option Grafana does not know",
        "stragglers",
        _set("panels.heatmap.options.yAxis.placement", "left"),
        "panels[0].options.yAxis.placement: a field",
    ),
    (
        "a heatmap cell gap that is not a number",
        "stragglers",
        _set("panels.heatmap.options.cellGap", "1px"),
        'panels[0].options.cellGap: "1px" is not',
    ),
    (
        "a time series line width that is not a number",
        "training",
        _set("panels.timeseries.fieldConfig.defaults.custom.lineWidth", "thin"),
        '.fieldConfig.defaults.custom.lineWidth: "thin" is not a number',
    ),
    (
        "a stat option of another panel kind",
        "training",
        _set("panels.stat.options.calculate", False),
        "panels[0].options.calculate: a field",
    ),
    ("a query field Prometheus' model does not know", "training", _set("panels.0.targets.0.legend", "x"), "legend: a"),
    ("a query instant flag as a string", "training", _set("panels.0.targets.0.instant", "no"), "is not a boolean"),
    ("a panel kind Grafana does not know", "training", _set("panels.0.type", "graph"), "the panel type 'graph'"),
    (
        "a variable refresh Grafana does not have",
        "training",
        _set("templating.list.1.refresh", "sometimes"),
        'templating.list[1].refresh: "sometimes" is none of 0, 1, 2',
    ),
    ("a variable field of the UI", "training", _set("templating.list.1.definition", "x"), "definition: a field"),
    ("a shared crosshair of 5", "training", _set("graphTooltip", 5), "graphTooltip: 5 is none of 0, 1, 2"),
    (
        "a table transformation field Grafana does not know",
        "stragglers",
        _set("panels.table.transformations.0.option", {}),
        "transformations[0].option: a field",
    ),
    ("a schema version as a string", "training", _set("schemaVersion", "41"), "schemaVersion"),
]


@pytest.mark.parametrize(("case", "name", "change", "problem"), BROKEN, ids=[c[0] for c in BROKEN])
def test_a_dashboard_grafanas_model_does_not_accept_fails_validate(
    case: str, name: str, change: Callable[[Board], None], problem: str
) -> None:
    board = copy.deepcopy(dashboards.build_all()[name])
    change(board)
    problems = dashboards.validate(board)
    assert any(problem in p for p in problems), (case, problems)
    assert all(p.startswith(f"{board['title']}: ") for p in problems), problems


def test_the_check_command_refuses_dashboards_grafanas_model_does_not_accept(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    reliability = BUILDERS["reliability"]

    def broken() -> Board:
        board = reliability()
        board["panels"][0]["gridPos"]["h"] = 4.5
        return board

    monkeypatch.setitem(BUILDERS, "reliability", broken)  # the dict build_all reads
    assert dashboards.main(["check", str(ROOT / "dashboards")]) == 1
    assert "opsd / Reliability: panels[0].gridPos.h: 4.5 is not an integer" in capsys.readouterr().err
