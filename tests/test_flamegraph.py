"""The flame graph of a run's collectives: folded stacks and the SVG (pure), phases in the tracer, the monitor and
on the wire, the agent's per-run totals in its heartbeat, the controller's endpoint over real HTTP, and the phases
of a real 2-rank FSDP2 job."""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import torch.distributed as dist
from fastapi.testclient import TestClient
from torch._C._distributed_c10d import OpType  # type: ignore[attr-defined]
from torch.distributed.pipelining.stage import _PipelineStageBase

from opsd.analysis.flamegraph import DIMENSION_COLOURS, MARGIN_PX, fold, parse_folded, render_svg, to_folded
from opsd.api.app import create_app
from opsd.backends.local.processes import free_port
from opsd.controller.controller import Controller
from opsd.controller.rows import RunSpec
from opsd.controller.state import StateStore
from opsd.controller.views import flame_stacks
from opsd.errors import BodyError, PermanentError
from opsd.protocol.answers import LastMeasured
from opsd.protocol.heartbeat import Heartbeat, decode_heartbeat
from opsd.protocol.heartbeat import encode as encode_heartbeat
from opsd.protocol.wire import MAX_MESSAGE_BYTES, StepReport, WireError, decode, decode_report, encode
from opsd_agent.daemon import Agent, AgentConfig
from opsd_agent.reporter import Reporter, ReporterConfig
from opsd_agent.state import RUN_OVERFLOW, NodeState
from tests.launch import run_module
from tests.serving import start_api
from tests.test_agent import samples, step, value
from tests.test_collectives import FakeWorkInfo, NcclLikeGroup
from tests.test_wire import report
from trainer_hooks.collectives import CollectiveTracer
from trainer_hooks.monitor import Monitor, MonitorConfig

SVG = "{http://www.w3.org/2000/svg}"
TOKEN = "flame-token"

# -- folded stacks -------------------------------------------------------------------------------------------------


def sent(heartbeat: Heartbeat) -> dict[str, Any]:
    """A heartbeat as it goes on the wire (JSON)."""
    body: dict[str, Any] = json.loads(encode_heartbeat(heartbeat))
    return body


def test_fold_sums_entries_into_microseconds_and_round_trips() -> None:
    entries = [
        ("forward", "dp_shard", "all_gather", 2.0),
        ("backward", "dp_shard", "reduce_scatter", 1.5),
        ("forward", "dp_shard", "all_gather", 0.25),  # the same stack again: added
        ("forward", "tp", "all_reduce", 0.0),  # no time: left out
        ("optimizer", "dp_replicate", "all_reduce", 1e-6, 3, 8),  # items after the seconds are ignored
    ]
    stacks = fold(entries)
    assert stacks == {
        ("step", "forward", "dp_shard", "all_gather"): pytest.approx(2_250_000),
        ("step", "backward", "dp_shard", "reduce_scatter"): pytest.approx(1_500_000),
        ("step", "optimizer", "dp_replicate", "all_reduce"): pytest.approx(1),
    }
    text = to_folded(stacks)
    assert text == (
        "step;backward;dp_shard;reduce_scatter 1500000\n"
        "step;forward;dp_shard;all_gather 2250000\n"
        "step;optimizer;dp_replicate;all_reduce 1\n"
    )
    assert parse_folded(text) == {stack: round(weight) for stack, weight in stacks.items()}
    assert to_folded({("step", "forward", "tp", "all_reduce"): 0.4}) == ""  # rounds to nothing


@pytest.mark.parametrize(
    "entry", [("forward", "tp", "all_reduce", -1.0), ("forward", "tp", "all_reduce", math.nan), ("forward", "tp")]
)
def test_fold_refuses_a_bad_entry(entry: tuple[Any, ...]) -> None:
    with pytest.raises(PermanentError, match="flame graph entry"):
        fold([entry])


def test_folded_frames_cannot_break_the_format() -> None:
    text = to_folded({("step", "a;b", "c\nd", ""): 5.0})
    assert text == "step;a_b;c_d;_ 5\n"
    assert parse_folded(text) == {("step", "a_b", "c_d", "_"): 5.0}


def test_parse_folded_skips_blank_lines_adds_repeats_and_reads_decimals() -> None:
    text = "a;b 3\n\n  \na;b 4\nc d;e 2.5\n"  # a frame may hold a space: the weight follows the last one
    assert parse_folded(text) == {("a", "b"): 7.0, ("c d", "e"): 2.5}


MALFORMED = {
    "no weight": "step;forward;tp",
    "weight not a number": "step;forward;tp x",
    "negative weight": "step;forward;tp -3",
    "nan weight": "step;forward;tp nan",
    "underscored weight": "step;forward;tp 1_000",
    "empty frame": "step;;tp 5",
    "weight alone": " 5",
}


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_folded_lines_are_refused_naming_the_line(name: str) -> None:
    with pytest.raises(PermanentError, match=r"folded line 2\b") as info:
        parse_folded("step;forward;tp;all_reduce 10\n" + MALFORMED[name] + "\n")
    assert MALFORMED[name].strip() in str(info.value) or "weight" in str(info.value)


# -- the SVG -------------------------------------------------------------------------------------------------------


def frames(svg: str) -> dict[str, tuple[ET.Element, ET.Element | None]]:
    """Tooltip text -> (rect, label text or None), one per frame; the document must parse as XML."""
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    out = {}
    for g in root.iter(f"{SVG}g"):
        title, rect = g.find(f"{SVG}title"), g.find(f"{SVG}rect")
        assert title is not None
        assert rect is not None
        assert title.text
        out[title.text] = (rect, g.find(f"{SVG}text"))
    assert len(out) == len(root.findall(f".//{SVG}rect"))  # every rect is a frame's
    return out


def test_svg_has_one_rect_per_frame_with_widths_proportional_to_weight() -> None:
    stacks = fold(
        [
            ("forward", "dp_shard", "all_gather", 2.0),
            ("forward", "tp", "all_reduce", 0.5),
            ("backward", "dp_shard", "reduce_scatter", 1.5),
        ]
    )
    svg = render_svg(stacks, "run r", width_px=1000)
    drawn = frames(svg)
    weights: dict[tuple[str, ...], float] = {}
    for stack, weight in stacks.items():
        for depth in range(len(stack) + 1):
            weights[stack[:depth]] = weights.get(stack[:depth], 0.0) + weight
    assert len(drawn) == len(weights) == 1 + 1 + 2 + 3 + 3  # all, step, 2 phases, 3 dimensions, 3 ops
    px_per_us = (1000 - 2 * MARGIN_PX) / 4_000_000
    geometry = {}
    for path, weight in weights.items():
        share = 100 * weight / 4_000_000
        (tooltip,) = [t for t in drawn if t.startswith(f"{';'.join(path) or 'all'} (") and f"{share:.2f}%" in t]
        rect = drawn[tooltip][0]
        x, width = float(rect.get("x", "")), float(rect.get("width", ""))
        assert width == pytest.approx(weight * px_per_us, abs=2e-3)
        geometry[path] = (x, width, float(rect.get("y", "")))
    assert "all (4.000 s, 100.00%)" in drawn
    assert "step;forward;tp;all_reduce (500.000 ms, 12.50%)" in drawn
    for path, (x, width, y) in geometry.items():  # each frame sits on its caller, within its span
        if path:
            px, pwidth, py = geometry[path[:-1]]
            assert y < py
            assert px - 1e-6 <= x
            assert x + width <= px + pwidth + 1e-3
    fill = {t.split(" (")[0]: r.get("fill") for t, (r, _) in drawn.items()}
    assert fill["step;forward;tp"] == fill["step;forward;tp;all_reduce"] == DIMENSION_COLOURS["tp"]
    assert fill["step;backward;dp_shard;reduce_scatter"] == DIMENSION_COLOURS["dp_shard"]


def test_svg_escapes_names_and_title_and_cuts_labels_to_fit() -> None:
    long_op = "a_very_long_collective_name_" * 4
    stacks: dict[tuple[str, ...], float] = {
        ("step", "forward", '<tp&"x">', "op\x01"): 1.0,
        ("step", "forward", "tp", long_op): 30.0,
        ("step", "backward", "pp", "send"): 1000.0,
    }
    svg = render_svg(stacks, "run <a & b>", width_px=400)
    root = ET.fromstring(svg)
    assert [t.text for t in root.findall(f"{SVG}text")] == ["run <a & b>"]
    drawn = frames(svg)
    assert any(t.startswith('step;forward;<tp&"x">;op? (') for t in drawn)
    rect, label = next(v for t, v in drawn.items() if t.startswith(f"step;forward;tp;{long_op} "))
    width = float(rect.get("width", ""))
    assert 0 < width < 20  # too narrow for any label
    assert label is None
    rect, label = next(
        v for t, v in drawn.items() if t.startswith("step;backward (") or t.startswith("step;backward;pp (")
    )
    assert label is not None
    assert label.text in ("backward", "pp")
    narrow = render_svg({("step", long_op): 1.0}, "t", width_px=120)
    texts = [t.text for t in ET.fromstring(narrow).iter(f"{SVG}text")]
    assert any(t and t.endswith("..") and len(t) < len(long_op) for t in texts)


def test_svg_of_nothing_is_a_valid_empty_graph() -> None:
    assert frames(render_svg({}, "run r")) == {}
    with pytest.raises(PermanentError, match="weight"):
        render_svg({("step",): -1.0}, "r")


# -- phases in the tracer and the monitor (a gloo world of one) ----------------------------------------------------


class AllReduceInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(grad)
        return grad * 2


def phases(t: CollectiveTracer) -> dict[tuple[str, str, str], int]:
    return {key: s.count for key, s in t.take_step().phases.items()}


def test_tracer_attributes_collectives_to_phases(tracer: CollectiveTracer) -> None:
    tracer.label(dist.group.WORLD, "dp_shard")  # type: ignore[arg-type]
    dist.all_reduce(torch.ones(2))
    assert phases(tracer) == {("dp_shard", "all_reduce", "other"): 1}  # outside a step
    tracer.default_phase = "forward"  # what the monitor sets inside a step
    x = torch.ones(3, requires_grad=True)
    y = AllReduceInBackward.apply(x)
    dist.all_reduce(torch.ones(2))
    y.sum().backward()  # the all-reduce inside runs in autograd's backward
    with tracer.phase("optimizer"):
        dist.all_reduce(torch.ones(2))
        with tracer.phase("backward"):  # marks nest
            dist.all_reduce(torch.ones(2))
        dist.all_reduce(torch.ones(2))
    assert phases(tracer) == {
        ("dp_shard", "all_reduce", "forward"): 1,
        ("dp_shard", "all_reduce", "backward"): 2,
        ("dp_shard", "all_reduce", "optimizer"): 2,
    }
    errors = tracer.internal_errors
    with tracer.phase("warmup"):  # not a phase: counted, never raised
        dist.all_reduce(torch.ones(2))
    assert tracer.internal_errors == errors + 1
    assert phases(tracer) == {("dp_shard", "all_reduce", "other"): 1}


def test_pipeline_direction_tells_forward_from_backward(tracer: CollectiveTracer) -> None:
    group = dist.group.WORLD
    assert isinstance(group, dist.ProcessGroup)
    # rank 0 of the group: a peer at 1 is a later stage
    assert tracer._p2p_phase(group, "send", None, 1) == "forward"
    assert tracer._p2p_phase(group, "recv", None, 1) == "backward"
    assert tracer._p2p_phase(group, "send", None, 0) is None  # itself: nothing to tell
    assert tracer._p2p_phase(group, "send", 5, None) is None  # not in the group
    with tracer.phase("optimizer"):
        assert tracer._p2p_phase(group, "send", None, 1) is None  # a mark wins


def test_a_pipeline_schedules_gradient_reduction_is_backward(tracer: CollectiveTracer) -> None:
    class Stage:  # what perform_reduce_grad reads first; reading it issues a collective, as FSDP's reduction does
        @property
        def submod(self) -> None:
            dist.all_reduce(torch.ones(1))

    tracer.default_phase = "forward"
    _PipelineStageBase.perform_reduce_grad(Stage(), 1)  # type: ignore[arg-type]
    assert phases(tracer) == {("other", "all_reduce", "backward"): 1}
    tracer.uninstall()
    assert not hasattr(_PipelineStageBase.perform_reduce_grad, "__wrapped__")
    tracer.install()


def test_completion_hook_durations_go_to_the_phase_of_their_issue(tracer: CollectiveTracer) -> None:
    group = NcclLikeGroup(dist.group.WORLD)  # type: ignore[arg-type]
    tracer.label(group, "tp")  # type: ignore[arg-type]
    tracer.default_phase = "forward"
    dist.all_reduce(torch.ones(5))
    with tracer.phase("optimizer"):
        dist.all_reduce(torch.ones(5))
    now = datetime.now()
    for ms in (3, 4, 5):  # the third was not seen issued: other
        group.hooks[0](FakeWorkInfo(OpType.ALLREDUCE, timedelta(milliseconds=ms), now, now))
    step = tracer.take_step()
    seconds = {key: s.seconds for key, s in step.phases.items()}
    assert seconds == {
        ("tp", "all_reduce", "forward"): pytest.approx(0.003),
        ("tp", "all_reduce", "optimizer"): pytest.approx(0.004),
        ("tp", "all_reduce", "other"): pytest.approx(0.005),
    }
    assert step.ops[("tp", "all_reduce")].count == 2


def test_monitor_reports_phases_and_the_loss_of_the_step(tmp_path: Path) -> None:
    tracer = CollectiveTracer()
    config = MonitorConfig(run_id="r", jsonl_path=str(tmp_path / "r.jsonl"), trace_collectives=False)
    monitor = Monitor(None, config, tracer=tracer)
    try:
        with monitor.step(tokens=8):
            tracer._issue(None, "all_reduce", 4)  # a collective as the wrappers count it (no process group here)
            with monitor.phase("optimizer"):
                tracer._issue(None, "all_gather", 8)
            monitor.record_loss(torch.tensor(2.5))
        with monitor.step(tokens=8):
            monitor.record_loss(float("nan"))  # not a number JSON can carry: left out
        tracer._issue(None, "broadcast", 2)  # after the step: not part of any step's report
        with monitor.step(tokens=8):
            pass
    finally:
        monitor.close()
    reports = [decode(line) for line in (tmp_path / "r.jsonl").read_bytes().splitlines()]
    assert [r["comms"] for r in reports] == [
        [["other", "all_gather", 1, 8, 0.0, "optimizer"], ["other", "all_reduce", 1, 4, 0.0, "forward"]],
        [],
        [],
    ]
    assert [r.get("loss") for r in reports] == [2.5, None, None]
    assert monitor.internal_errors == 0


# -- the wire ------------------------------------------------------------------------------------------------------


def test_wire_accepts_five_and_six_element_entries_and_refuses_a_bad_phase() -> None:
    comms = [["tp", "all_reduce", 1, 8, 0.1], ["pp", "send", 2, 16, 0.2, "backward"], ["ep", "a2a", 1, 1, 0, "x", 9]]
    with pytest.raises(WireError) as info:
        decode_report(encode(report(comms=comms)))
    assert info.value.reason == "comms"
    assert "$.comms[2][5]" in str(info.value)
    comms[2] = ["ep", "all_to_all", 1, 1, 0.0, "optimizer", "a newer element"]  # elements past the 6th: ignored
    decoded = decode_report(encode(report(comms=comms, loss=2.25)))
    assert isinstance(decoded, StepReport)
    assert [(e.dimension, e.phase) for e in decoded.comms] == [("tp", "other"), ("pp", "backward"), ("ep", "optimizer")]
    assert decoded.loss == 2.25
    without = decode_report(encode(report()))
    assert isinstance(without, StepReport)
    assert without.loss is None  # optional
    with pytest.raises(WireError, match=r"\$\.loss"):
        decode_report(json.dumps(report(loss="2.5")).encode())


def test_an_oversized_report_drops_the_phases_before_the_comms() -> None:
    phases = ("forward", "backward", "optimizer", "other")
    comms = [[f"d{i % 3}", "all_reduce", 1, 10, 0.5, phases[i % 4]] for i in range(240)]
    data = encode(report(comms=comms))
    assert len(data) <= MAX_MESSAGE_BYTES
    decoded = decode(data)
    assert decoded["truncated"] is True
    assert sorted(decoded["comms"]) == [[f"d{i}", "all_reduce", 80, 800, pytest.approx(40.0)] for i in range(3)]


# -- the agent -----------------------------------------------------------------------------------------------------


def test_agent_heartbeat_carries_each_runs_totals_by_phase() -> None:
    state = NodeState()
    state.ingest(step(rank=0, comms=[["dp_shard", "all_gather", 5, 100, 0.5, "forward"]]), now_s=1.0)
    state.ingest(step(rank=1, comms=[["dp_shard", "all_gather", 5, 100, 0.25, "forward"]]), now_s=1.0)
    state.ingest(step(rank=1, comms=[["tp", "all_reduce", 2, 8, 0.125]]), now_s=2.0)  # no phase: other
    state.ingest(step(run="s", rank=0, comms=[["pp", "send", 1, 4, 1.0, "backward"]]), now_s=2.0)
    reporter = Reporter(ReporterConfig(url="http://127.0.0.1:9/v1/heartbeat"), "n1", state, None)
    body = sent(reporter.heartbeat(3.0))
    assert body["comms"] == [
        ["r", "forward", "dp_shard", "all_gather", 0.75, 10, 200],
        ["r", "other", "tp", "all_reduce", 0.125, 2, 8],
        ["s", "backward", "pp", "send", 1.0, 1, 4],
    ]
    decode_heartbeat(json.dumps(body).encode())  # the controller's schema takes it
    (r0,) = [r for r in state.snapshot() if (r.run, r.rank) == ("r", 0)]
    assert set(r0.comms) == {("dp_shard", "all_gather")}  # per rank, by (dimension, op) only
    state.expire(now_s=1000.0)
    assert sent(reporter.heartbeat(1001.0))["comms"] == []  # forgotten with the run's last rank


def test_agent_run_totals_are_capped_and_labels_checked() -> None:
    state = NodeState(max_comm_series=1)  # 4 stacks per run, the last of them the overflow
    comms = [[f"d{i}", "all_reduce", 1, 1, 1.0, "forward"] for i in range(5)] + [["a;b c", "x\ny", 1, 1, 1.0]]
    state.ingest(step(comms=comms), now_s=0.0)
    stacks = {(c.phase, c.dimension, c.op): c.seconds for c in state.run_comms()}
    assert len(stacks) == 4
    assert stacks[RUN_OVERFLOW] == 3.0  # d3, d4 and the unlabelled one
    state = NodeState()
    state.ingest(step(comms=[["a;b c", "x\ny", 1, 1, 1.0]]), now_s=0.0)
    assert [(c.dimension, c.op) for c in state.run_comms()] == [("other", "other")]


def test_agent_exposes_the_loss_and_the_overlapped_time(tmp_path: Path) -> None:
    agent = Agent(AgentConfig(socket=str(tmp_path / "a.sock"), metrics_port=0, node="n1"))
    agent.handle(encode(report(loss=2.75, overlapped_comm_s=0.125)))
    labels = {"run": "r", "rank": "3"}
    assert value(agent, "opsd_loss", **labels) == 2.75
    assert value(agent, "opsd_step_overlapped_comm_seconds", **labels) == 0.125
    agent.handle(encode(report()))  # a step without a loss: the series goes
    assert ("opsd_loss", tuple(sorted(labels.items()))) not in samples(agent)


# -- the controller ------------------------------------------------------------------------------------------------


def test_heartbeat_schema_refuses_bad_comms_rows() -> None:
    body = {"v": 1, "node": "n", "time_unix_s": 1.0}
    for row in (
        ["r", "forward", "tp", "all_reduce", -1.0, 1, 1],
        ["r", "forward", "tp"],
        ["r", "", "tp", "x", 1, 1, 1],
    ):
        with pytest.raises(BodyError, match=r"\$\.comms\[0\]"):
            decode_heartbeat(json.dumps({**body, "comms": [row]}).encode())


def test_controller_groups_rows_by_run_and_ignores_unknown_runs(tmp_path: Path) -> None:
    controller = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"))
    controller.known_runs = {"a", "b"}
    rows = [("a", "forward", "tp", "all_reduce", 1.0, 1, 1), ("b", "backward", "pp", "send", 2.0, 1, 1)]
    rows += [("a", "backward", "tp", "all_reduce", 3.0, 1, 1), ("c", "forward", "tp", "all_reduce", 4.0, 1, 1)]
    controller.intake._comms(rows, "n1")
    assert controller.comm_seconds("a") == {("forward", "tp", "all_reduce"): 1.0, ("backward", "tp", "all_reduce"): 3.0}
    assert controller.comm_seconds("b") == {("backward", "pp", "send"): 2.0}
    assert controller.comm_seconds("c") == {}  # not a run of the store


def launch_beat(at_s: float, step_: int, comms: list[tuple[str, str, str, float]], mfu: float) -> Heartbeat:
    """node n1's heartbeat: rank 0 of run r at ``step_`` (its report at ``at_s``), and its agent's collective
    totals (cumulative)."""
    rank = {"run": "r", "rank": 0, "step": step_, "step_s": 0.5, "mfu_ratio": mfu, "job_tokens_per_s": 1e3}
    body = {
        "v": 1,
        "node": "n1",
        "time_unix_s": at_s,
        "ranks": [{**rank, "last_report_unix_s": at_s}],
        "comms": [["r", phase, dim, op, seconds, 1, 8] for phase, dim, op, seconds in comms],
    }
    return msgspec.convert(body, Heartbeat)


def test_each_launch_keeps_its_collective_time_and_figures_after_the_run_and_a_restart(tmp_path: Path) -> None:
    store = StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}")
    store.create_run("r", RunSpec(), 0.0)
    store.update_run("r", 0.0, generation=1)
    controller = Controller(store)
    controller.heartbeat(launch_beat(10.0, 5, [("forward", "tp", "all_reduce", 1.0)], mfu=0.4), 10.0)
    controller.tick(11.0)  # the launch's first record
    controller.heartbeat(launch_beat(25.0, 9, [("forward", "tp", "all_reduce", 1.5)], mfu=0.5), 25.0)
    controller.tick(26.0)  # 15 s later and progressed: recorded again
    controller.forget_ranks("r", 30.0)  # the relaunch: launch 1 is recorded, launch 2 counts from here
    store.update_run("r", 31.0, generation=2)
    totals = [("forward", "tp", "all_reduce", 1.5), ("backward", "tp", "all_reduce", 2.0)]
    controller.heartbeat(launch_beat(40.0, 8, totals, mfu=0.3), 40.0)
    store.update_run("r", 50.0, state="completed")
    controller.tick(50.5)  # a finished run's launch is recorded once more
    forward, backward = ("forward", "tp", "all_reduce"), ("backward", "tp", "all_reduce")

    restarted = Controller(store)  # nothing in memory: every figure comes from the store
    assert flame_stacks(restarted, "r", 1) == {forward: 1.5}
    assert flame_stacks(restarted, "r", 2) == {backward: 2.0}
    assert flame_stacks(restarted, "r", None) == {forward: 1.5, backward: 2.0}
    assert flame_stacks(restarted, "r", 3) == {}
    status = restarted.status("r", 60.0)
    assert status is not None
    assert (status.mfu_ratio, status.ranks) == (0.0, 0)  # nothing live
    assert status.last_measured == LastMeasured(
        launch=2,
        mfu_ratio=0.3,
        tokens_per_s=1e3,
        at_unix_s=50.5,
        pipeline=None,  # no stage reported a bubble
        pipeline_launch=None,
    )
    assert status.run_average is not None
    assert status.run_average.samples == 3
    assert status.run_average.mfu_ratio == pytest.approx((0.4 + 0.5 + 0.3) / 3)
    (one, two) = store.launches("r")
    assert (one.first_step, one.last_step, two.first_step, two.last_step) == (5, 9, 8, 8)
    client = TestClient(create_app(restarted, TOKEN), headers={"Authorization": f"Bearer {TOKEN}"})
    answer = client.get("/v1/runs/r/flamegraph", params={"launch": 2})
    assert parse_folded(answer.text) == {("step", "backward", "tp", "all_reduce"): 2_000_000}
    assert client.get("/v1/runs/r/flamegraph", params={"launch": 0}).status_code == 422


def node_state(comms: list[list[Any]]) -> NodeState:
    state = NodeState()
    state.ingest(step(rank=0, comms=comms), now_s=1.0)
    return state


def get(url: str) -> tuple[str, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})  # reads want the token
    with urllib.request.urlopen(request, timeout=5) as reply:
        return reply.headers["Content-Type"], reply.read().decode()


def test_controller_flamegraph_sums_the_nodes_over_real_http(tmp_path: Path) -> None:
    controller = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"))
    port = free_port()
    server = start_api(controller, TOKEN, "127.0.0.1", port)
    base = f"http://127.0.0.1:{port}"
    config = ReporterConfig(url=f"{base}/v1/heartbeat", token=TOKEN)
    try:
        one = node_state([["dp_shard", "all_gather", 5, 100, 0.5, "forward"], ["tp", "all_reduce", 2, 8, 0.25]])
        two = node_state([["dp_shard", "all_gather", 5, 100, 0.75, "forward"]])
        assert Reporter(config, "n1", one, None).send_once(now_s=10.0)
        assert Reporter(config, "n2", two, None).send_once(now_s=10.0)
        assert Reporter(config, "n2", two, None).send_once(now_s=11.0)  # the same totals again: replaced, not added
        content_type, text = get(f"{base}/v1/runs/r/flamegraph")
        assert content_type.startswith("text/plain")
        assert parse_folded(text) == {
            ("step", "forward", "dp_shard", "all_gather"): 1_250_000,
            ("step", "other", "tp", "all_reduce"): 250_000,
        }
        # n1's agent restarts: its totals start from zero; the run's do not go backwards
        assert Reporter(config, "n1", node_state([["tp", "all_reduce", 1, 8, 0.125]]), None).send_once(now_s=12.0)
        assert parse_folded(get(f"{base}/v1/runs/r/flamegraph")[1]) == {
            ("step", "forward", "dp_shard", "all_gather"): 1_250_000,
            ("step", "other", "tp", "all_reduce"): 375_000,
        }
        with pytest.raises(urllib.error.HTTPError) as info:
            get(f"{base}/v1/runs/nope/flamegraph")
        assert info.value.code == 404
    finally:
        server.should_exit = True


# -- a real 2-rank FSDP2 job -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_fsdp_collectives_land_in_their_phases(tmp_path: Path) -> None:
    layers = 2
    args = ["--mesh", "dp_shard=2", "--steps", "2", "--layers", str(layers), "--opsd-monitor"]
    args += ["--opsd-jsonl", str(tmp_path / "r{rank}.jsonl")]
    proc = run_module(
        "examples.train",
        args,
        nproc=2,
        env={"OMP_NUM_THREADS": "1"},
        timeout_s=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = NodeState()
    for rank in (0, 1):
        reports = [decode_report(line) for line in (tmp_path / f"r{rank}.jsonl").read_bytes().splitlines()]
        assert len(reports) == 2
        last = reports[-1]
        assert isinstance(last, StepReport)
        counts = {(e.dimension, e.op, e.phase): e.count for e in last.comms}
        units = layers + 1  # one FSDP unit per block, and the root
        assert counts == {
            ("dp_shard", "all_gather", "forward"): units,  # gathered for forward
            ("dp_shard", "all_gather", "backward"): units,  # resharded after forward: gathered again
            ("dp_shard", "reduce_scatter", "backward"): units,  # the gradients
        }
        assert all(e.seconds > 0 for e in last.comms)
        assert last.loss is not None
        assert 0 < last.loss < 10
        for r in reports:
            assert isinstance(r, StepReport)
            state.ingest(r, now_s=1.0)
    reporter = Reporter(ReporterConfig(url="http://127.0.0.1:9/v1/heartbeat"), "n", state, None)
    rows = sent(reporter.heartbeat(2.0))["comms"]
    stacks = fold(row[1:] for row in rows)
    assert {s[1:] for s in stacks} == {
        ("forward", "dp_shard", "all_gather"),
        ("backward", "dp_shard", "all_gather"),
        ("backward", "dp_shard", "reduce_scatter"),
    }
    assert re.fullmatch(r"(step;\w+;dp_shard;\w+ \d+\n){3}", to_folded(stacks))
