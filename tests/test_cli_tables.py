"""The operator's tables at 80 and 200 columns, narrow and --wide, from answers shaped as the API's: key cells (ids,
names, states, numbers) whole on their row's line, no line wider than the terminal in the narrow form, free text
wrapped or left out, and the --wide columns."""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
from rich.console import Console, RenderableType

from opsd.cli import tables
from opsd.cli.columns import echo
from opsd.protocol.answers import CadenceView, Checkpoints, RunStatus, SparePools, decode_answer
from opsd.protocol.bundle import RunSummary
from opsd.protocol.records import Action, IncidentRow

RUN = "llama-3-405b-pretrain-stage2"
OTHER = "mixtral-8x22b-sft-v3"
NODE = "gpu-node-0117.cluster.example.com"
SPARE = "gpu-node-0342.cluster.example.com"
DOWN = "gpu-node-0118.cluster.example.com"
SHARED = "gpu-node-0400.cluster.example.com"
T0 = 1_760_000_000.0  # 2025-10-09 08:53:20 UTC
TIMEOUT = (
    "rank 4021 waits in all_reduce seq 88121 of process group tp:3 for 600.0 s; rank 4022 waits in all_gather"
    " seq 88120 of process group dp_shard:7; named by the Flight Recorder: rank 4019"
)
TORN = "shard 1717 of 16384 missing: rank 1717 never wrote __1717_0.distcp"

RUNS = [
    {
        "id": RUN,
        "state": "waiting_for_spare",
        "generation": 12,
        "last_step": 1234567,
        "created_s": T0,
        "updated_s": T0 + 86400,
    },
    {"id": OTHER, "state": "running", "generation": 1, "last_step": 4410, "created_s": T0 + 100, "updated_s": T0 + 200},
]


A = TypeVar("A")
RunsAnswer, Incidents, Actions = tuple[RunSummary, ...], tuple[IncidentRow, ...], tuple[Action, ...]


def typed(body: Any, kind: type[A] = RunStatus) -> A:  # type: ignore[assignment]
    """An answer shaped as the API's, decoded as the CLI decodes it."""
    return decode_answer(body, kind, "answer")


def status(run: str, state: str, step: int) -> dict[str, Any]:
    return {
        "run": run,
        "state": state,
        "generation": 12,
        "step": step,
        "ranks": 16384,
        "mfu_ratio": 0.4123,
        "tokens_per_s": 2345678.0,
        "ettr": 0.9312,
        "badput_s": {"restart": 120.5, "lost_work": 300.0},
        "mtbf_s": 10800.0,
        "cadence": {"every_steps": 250, "from_step": 1234500, "reason": "Young"},
        "nodes": [
            {"name": SPARE, "role": "active", "reason": ""},
            {"name": DOWN, "role": "spare", "reason": ""},
            {"name": NODE, "role": "cordoned", "reason": "XID 79: GPU has fallen off the bus"},
        ],
        "spares_available": 3,
        "stragglers": [{"rank": 4021, "node": NODE, "slowdown_ratio": 1.27}],
        "open_incidents": 1,
    }


INCIDENTS = [
    {
        "id": 1041,
        "key": f"{RUN}:{NODE}:collective_timeout:12",
        "run": RUN,
        "kind": "collective_timeout",
        "node": NODE,
        "rank": 4021,
        "detail": TIMEOUT,
        "state": "recovered",
        "failed_s": T0,
        "detected_s": T0 + 12.5,
        "resumed_s": T0 + 340.25,
        "resumed_from_step": 1234000,
        "lost_steps": 567,
        "spare": SPARE,
    },
    {
        "id": 1042,
        "key": f"{OTHER}:{SPARE}:heartbeat_loss:1",
        "run": OTHER,
        "kind": "heartbeat_loss",
        "node": SPARE,
        "rank": None,
        "detail": "no heartbeat for 41.2 s > 30.0 s",
        "state": "open",
        "failed_s": T0,
        "detected_s": T0 + 41.2,
        "resumed_s": None,
        "resumed_from_step": None,
        "lost_steps": None,
        "spare": None,
    },
]


def action(
    seq: int, kind: str, args: dict[str, Any], result: dict[str, Any] | None, took_s: float | None
) -> dict[str, Any]:
    start = T0 + 13 + 10 * seq
    return {
        "request_id": f"incident-1041-{seq}-{kind}",
        "incident_id": 1041,
        "run": RUN,
        "seq": seq,
        "kind": kind,
        "args": args,
        "state": "pending" if result is None else "done",
        "created_s": start,
        "done_s": None if took_s is None else start + took_s,
        "result": result,
    }


ACTIONS = [
    action(0, "dump", {"trigger": "incident-1041"}, {"ranks": [4019, 4021], "missing": []}, 30.0),
    action(1, "cordon", {"node": NODE, "reason": "collective_timeout"}, {"node": NODE, "quarantined": True}, 1.0),
    action(2, "take_spare", {"for": NODE}, {"spare": SPARE}, 15.0),
    action(3, "launch", {"after_generation": 11}, None, None),
]

WHY = (
    "P(more than 12 of 2048 nodes fail within 24 h) <= 0.01 at a node MTBF of 50,000 h"
    " (3 failures in 120,400.5 node-hours, with the prior)"
)
SPARES = {
    "runs": [
        {
            "run": RUN,
            "state": "waiting_for_spare",
            "active_nodes": 2048,
            "spares": [
                {"name": SPARE, "domain": "rack-7", "health": "healthy", "why": ""},
                {"name": DOWN, "domain": "rack-2", "health": "unreachable", "why": "no heartbeat"},
            ],
            "available": 1,
            "recommended": 12,
            "why": WHY,
            "cordoned": [{"name": NODE, "reason": "XID 79"}],
        },
        {
            "run": OTHER,
            "state": "running",
            "active_nodes": 8,
            "spares": [],
            "available": 0,
            "recommended": 1,
            "why": "P(more than 1 of 8 nodes fail within 24 h) <= 0.01",
            "cordoned": [],
        },
    ],
    "shared": {
        "active_nodes": 2056,
        "spares": [{"name": SHARED, "domain": "rack-9", "health": "unknown", "why": ""}],
        "available": 1,
        "recommended": 13,
        "why": "P(more than 13 of 2056 nodes of 2 runs fail within 24 h) <= 0.01",
    },
}

CHECKPOINTS = {
    "run": RUN,
    "url": f"s3://training-checkpoints/{RUN}",
    "checkpoints": [
        {
            "step": 1234750,
            "state": "torn",
            "problem": TORN,
            "bytes": 2_100_000_000_000,
            "time_unix_s": None,
            "blocking_s": None,
            "save_s": None,
        },
        {
            "step": 1234500,
            "state": "committed",
            "problem": None,
            "bytes": 5_200_000_000_000,
            "time_unix_s": T0,
            "blocking_s": 2.3456,
            "save_s": 41.234,
        },
    ],
}

CADENCE = {
    "run": RUN,
    "step": 1234567,
    "nodes": 2048,
    "failures": 3,
    "node_hours": 120400.5,
    "node_mtbf_h": 50000.0,
    "mtbf_s": 87.9,
    "checkpoint_cost_s": 2.3456,
    "step_s": 4.123,
    "young_interval_s": 20.3,
    "daly_interval_s": 19.1,
    "cadence": {"every_steps": 250, "from_step": 1234500, "interval_s": 1030.0, "every_s": 1030.75, "mtbf_s": 87.9},
    "previous": {"every_steps": 300, "from_step": 1200000},
    "why": "Young's interval sqrt(2 * 2.346 s * 87.9 s) at a run MTBF of 88 s, rounded to 250 steps of 4.123 s",
}


@dataclass
class Case:
    build: Callable[[bool], RenderableType]
    narrow: list[list[str]]  # the key cells of a row of the narrow form, in order, that must be on one line
    wide: list[list[str]]  # ... of the --wide form
    wide_only: list[str] = field(default_factory=list)  # texts the --wide form shows and the narrow one does not


STATUS = [["state", "waiting_for_spare (launch 12)"], ["step", "1234567"], ["ETTR", "0.931"], ["open incidents", "1"]]
INCIDENT = [["run", RUN], ["node", NODE], ["spare", SPARE], ["lost steps", "567"], ["resumed from step", "1234000"]]
CADENCE_ROWS = [
    ["cadence", "every 250 steps from step 1234500"],
    ["node MTBF (h)", "50,000"],
    ["step time (s)", "4.123"],
]
CASES = {
    "runs": Case(
        lambda wide: tables.runs_table(typed(RUNS, RunsAnswer), wide),
        [[RUN, "waiting_for_spare", "1234567", "2025-10-10 08:53:20"], [OTHER, "running", "4410"]],
        [[RUN, "waiting_for_spare", "12", "1234567", "2025-10-09 08:53:20", "2025-10-10 08:53:20"]],
        ["launch", "started (UTC)"],
    ),
    "statuses": Case(
        lambda wide: tables.statuses_table(
            [typed(status(RUN, "waiting_for_spare", 1234567)), typed(status(OTHER, "running", 4410))], wide
        ),
        [[RUN, "waiting_for_spare", "1234567", "0.931", "1"], [OTHER, "running", "4410", "0.931", "1"]],
        [[RUN, "waiting_for_spare", "1234567", "16384", "0.412", "2345678", "0.931", "3", "1", "1"]],
        ["MFU", "tokens/s", "stragglers"],
    ),
    "status": Case(
        lambda wide: tables.status_table(typed(status(RUN, "waiting_for_spare", 1234567)), wide),
        [*STATUS, ["nodes", "1 active, 1 spare, 1 cordoned"]],
        [*STATUS, ["nodes", f"{SPARE} (active)"], [f"{DOWN} (spare)"], [NODE], ["run MTBF (s)", "10800"]],
        [NODE, "badput (s)", "run MTBF (s)"],
    ),
    "incidents": Case(
        lambda wide: tables.incidents_table(typed(INCIDENTS, Incidents), wide),
        [["1041", RUN, "collective_timeout", "recovered"], ["1042", OTHER, "heartbeat_loss", "open"]],
        [["1041", RUN, "collective_timeout", NODE, "4021", "recovered", "12.5", "327.8", "567"]],
        [NODE, "detected after s", "lost steps"],
    ),
    "incidents of a run": Case(
        lambda wide: tables.incidents_table(typed(INCIDENTS[:1], Incidents), wide, run=RUN),
        [["1041", "collective_timeout", "recovered"]],
        [["1041", "collective_timeout", NODE, "4021", "recovered", "12.5", "327.8", "567"]],
        [NODE, "recovered after s"],
    ),
    "incident": Case(
        lambda wide: tables.incident_view(typed(INCIDENTS[0], IncidentRow), typed(ACTIONS, Actions), wide),
        [*INCIDENT, ["0", "dump", "done", "30.0"], ["3", "launch", "pending", "-"], [f"→ spare: {SPARE}"]],
        [*INCIDENT, ["1", "cordon", "done", "2025-10-09 08:53:43", "1.0", "incident-1041-1-cordon"]],
        ["incident-1041-1-cordon", "started (UTC)"],
    ),
    "spares": Case(
        lambda wide: tables.spares_table(typed(SPARES, SparePools), wide),
        [
            [RUN, "1 healthy", "1", "12", "1"],
            ["1 unreachable"],
            [OTHER, "-", "0", "1", "0"],
            ["(shared pool)", "1 unknown", "1", "13", "0"],
        ],
        [
            [RUN, "waiting_for_spare", "2048", f"{SPARE} (healthy)", "1", "12", NODE],
            [f"{DOWN} (unreachable)"],
            ["(shared pool)", "-", "2056", f"{SHARED} (unknown)", "1", "13", "-"],
        ],
        [SPARE, SHARED, "active nodes", "P(more than"],
    ),
    "checkpoints": Case(
        lambda wide: tables.checkpoints_table(typed(CHECKPOINTS, Checkpoints), wide),
        [["1234750", "torn", "1.9 TiB", "-"], ["1234500", "committed", "4.7 TiB", "2025-10-09 08:53:20"]],
        [["1234500", "committed", "4.7 TiB", "2025-10-09 08:53:20", "2.346", "41.23"]],
        ["blocking s", "save s"],
    ),
    "cadence": Case(
        lambda wide: tables.cadence_table(typed(CADENCE, CadenceView), wide),
        CADENCE_ROWS,
        [*CADENCE_ROWS, ["interval (s)", "1030.0"], ["previous cadence", "every 300 steps from step 1200000"]],
        ["previous cadence", "newest step"],
    ),
}


def render(renderable: RenderableType, width: int) -> str:
    buffer = io.StringIO()
    echo(renderable, Console(width=width, file=buffer, color_system=None))
    return buffer.getvalue()


def on_one_line(out: str, cells: list[str]) -> bool:
    """Whether one line of ``out`` has ``cells`` whole, in order, each set apart by spaces."""
    pattern = r"(?:^|\s)" + r"\s+".join(re.escape(c) for c in cells) + r"(?:\s|$)"
    return any(re.search(pattern, line) for line in out.splitlines())


def widest(out: str) -> int:
    return max(len(line) for line in out.splitlines())


@pytest.mark.parametrize("width", [80, 200])
@pytest.mark.parametrize("name", sorted(CASES))
def test_key_cells_stay_whole_and_lines_fit(name: str, width: int) -> None:
    case = CASES[name]
    out = render(case.build(False), width)
    assert widest(out) <= width, out
    for cells in case.narrow:
        assert on_one_line(out, cells), (cells, out)
    for text in case.wide_only:
        assert text not in out, (text, out)


@pytest.mark.parametrize("width", [80, 200])
@pytest.mark.parametrize("name", sorted(CASES))
def test_wide_shows_the_extra_columns_and_keeps_every_key_cell_whole(name: str, width: int) -> None:
    case = CASES[name]
    out = render(case.build(True), width)
    for cells in case.wide:
        assert on_one_line(out, cells), (cells, out)
    for text in case.wide_only:
        assert text in out, (text, out)


def test_free_text_wraps_and_gives_way() -> None:
    of_run = render(tables.incidents_table(typed(INCIDENTS[:1], Incidents), run=RUN), 80)
    assert widest(of_run) <= 80
    assert TIMEOUT in " ".join(of_run.split())  # wrapped over several lines, every word of it there
    assert len(of_run.splitlines()) > 5
    every = render(
        tables.incidents_table(typed(INCIDENTS, Incidents)), 80
    )  # the run column leaves the detail too little room
    assert "all_reduce" not in every
    assert "detail: left out for want of room: opsd incidents RUN ID shows it" in " ".join(every.split())
    assert TIMEOUT in " ".join(render(tables.incidents_table(typed(INCIDENTS, Incidents)), 200).split())
    torn = render(tables.checkpoints_table(typed(CHECKPOINTS, Checkpoints)), 80)
    assert TORN in " ".join(torn.split())
    assert not on_one_line(torn, [TORN])  # it wrapped; the key columns did not


def test_names_wider_than_the_terminal_make_lines_longer_not_shorter() -> None:
    long_run = "a-very-long-run-name-" * 4 + "stage2"
    out = render(tables.runs_table(typed([{**RUNS[0], "id": long_run}], RunsAnswer)), 80)
    assert on_one_line(out, [long_run, "waiting_for_spare", "1234567", "2025-10-10 08:53:20"]), out
    assert widest(out) > 80


def test_cells_are_not_read_as_markup() -> None:
    body = [{**INCIDENTS[1], "detail": "[bold]rank 3[/bold] waits [rank 4]"}]
    assert "[bold]rank 3[/bold] waits [rank 4]" in render(
        tables.incidents_table(typed(body, Incidents), run=OTHER), 200
    )


def test_a_finished_run_shows_its_last_measured_figures_labelled_and_its_averages() -> None:
    finished = {
        **status(RUN, "completed", 1234567),
        "ranks": 0,
        "mfu_ratio": 0.0,
        "tokens_per_s": 0.0,
        "last_measured": {"launch": 3, "mfu_ratio": 0.412, "tokens_per_s": 51234.0, "at_unix_s": 1.0},
        "run_average": {"mfu_ratio": 0.398, "tokens_per_s": 49000.0, "samples": 40},
    }
    out = render(tables.status_table(typed(finished)), 200)
    assert "0.412 (last measured, launch 3); run average 0.398" in out
    assert "51234 (last measured, launch 3); run average 49000" in out
    listed = render(tables.statuses_table([typed(finished)], wide=True), 200)
    assert on_one_line(listed, [RUN, "completed", "1234567", "0", "0.412 (last)", "51234 (last)"])
    live = render(
        tables.status_table(typed({**status(RUN, "running", 5), "run_average": finished["run_average"]})), 200
    )
    assert "0.412; run average 0.398" in live  # the ranks report: their figure, not the last recorded


PIPELINE = {
    "bubble_ratio": 0.412,
    "theoretical_ratio": 0.273,
    "margin_ratio": 0.1,
    "over_theory": True,
    "schedule": "1f1b",
    "stages": 4,
    "microbatches": 8,
    "stage_ratios": {"0": 0.39, "1": 0.45},
}


def test_the_status_says_what_is_held_and_which_agents_are_down() -> None:
    quiet = render(tables.status_table(typed(status(RUN, "running", 5))), 200)
    assert "maintenance" not in quiet
    assert "agents down" not in quiet
    body = {
        **status(RUN, "running", 5),
        "maintenance": {"every_run": True, "reason": "switch firmware", "since_s": 1700000000.0},
        "agents_down": [{"node": NODE, "detail": "no heartbeat for 12.0 s > 10.0 s; its ranks' peers stepped"}],
    }
    out = render(tables.status_table(typed(body)), 200)
    assert "recoveries held (every run)" in out
    assert "switch firmware" in out
    assert f"{NODE} (their ranks train: nothing recovered)" in out


@pytest.mark.parametrize(
    ("pipeline", "wide", "expected"),
    [
        (
            PIPELINE,
            False,
            "0.41 measured, theory 0.27 (1f1b, 4 stages x 8 micro-batches), 0.14 over (more than the margin 0.10)",
        ),
        ({**PIPELINE, "bubble_ratio": 0.25, "over_theory": False}, False, "0.25 measured, theory 0.27 (1f1b, "),
        (
            {**PIPELINE, "theoretical_ratio": None, "over_theory": False},
            True,
            "0.41 measured; by stage 0: 0.39, 1: 0.45",
        ),
    ],
    ids=["over-the-margin", "under-the-theory", "no-theory-wide"],
)
def test_the_status_shows_the_pipeline_bubble_beside_its_theory(
    pipeline: dict[str, Any], wide: bool, expected: str
) -> None:
    out = render(tables.status_table(typed({**status(RUN, "running", 5), "pipeline": pipeline}), wide), 200)
    assert expected in out
    if not pipeline["over_theory"]:
        assert "margin" not in out
    assert "pipeline bubble" not in render(tables.status_table(typed(status(RUN, "running", 5))), 200)
