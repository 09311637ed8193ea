"""The post-mortem report: the facts it draws from a bundle (tests/postmortem_bundle.json: a fatal XID 79 swap
resumed from an older checkpoint because the newest was torn, two straggler warnings, a hang with a Flight
Recorder analysis), bad bundles, escaping, and the HTML page as headless Chromium draws it."""

from __future__ import annotations

import base64
import copy
import io
import json
import os
import re
import shutil
import signal
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import pytest
from PIL import Image

from opsd.controller.rows import RunSpec
from opsd.errors import PermanentError
from opsd.postmortem.build import build, signal_name
from opsd.postmortem.model import Report
from opsd.postmortem.render import to_html, to_markdown

FIXTURE = Path(__file__).with_name("postmortem_bundle.json")


@pytest.fixture
def bundle() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def run_html() -> str:
    return to_html(build(json.loads(FIXTURE.read_text())))


def incident(report: Report, ident: int) -> Any:
    (found,) = [i for i in report.incidents if i.id == ident]
    return found


def test_fatal_xid_root_cause_timeline_and_resume(bundle: dict[str, Any]) -> None:
    xid = incident(build(bundle), 1)
    cause = xid.root_cause.xid
    assert (cause.code, cause.gpu, cause.node) == (79, 0, "node-1")
    assert (cause.meaning, cause.action) == ("GPU has fallen off the bus", "cordon_and_swap")
    assert xid.detection_delay_s == pytest.approx(1.2)
    assert xid.downtime_s == pytest.approx(20.0)
    assert xid.lost_steps == 14
    assert xid.recompute_s == pytest.approx(22.0 * 14 / 22)  # the run's recompute badput, by lost steps
    assert xid.spare == "node-2"
    phases = [(p.name, p.start_s, p.end_s) for p in xid.timeline]
    assert [name for name, _, _ in phases] == [
        "failure",
        "detection",
        "stop",
        "cordon",
        "swap",
        "relaunch",
        "first step",
    ]
    # the actions were all recorded at +1.3 s and done one after the other
    expected = [(0.0, 0.0), (0.0, 1.2), (1.3, 2.0), (2.0, 2.1), (2.1, 2.4), (2.4, 8.0), (8.0, 20.0)]
    for (_, start, end), (want_start, want_end) in zip(phases, expected, strict=True):
        assert (start, end) == (pytest.approx(want_start, abs=1e-6), pytest.approx(want_end, abs=1e-6))
    assert "took spare node-2" in xid.timeline[4].detail
    assert xid.resume.step == 30
    assert xid.resume.reason == "step 30: the newest, step 40, was torn: no manifest (the save did not finish)"


def test_hang_culprit_from_the_flight_recorder(bundle: dict[str, Any]) -> None:
    hang = incident(build(bundle), 4)
    assert hang.detection_delay_s == pytest.approx(20.5)
    assert [p.name for p in hang.timeline] == ["failure", "detection", "dump", "stop", "relaunch", "first step"]
    analysis = hang.root_cause.flight_recorder
    assert analysis is not None
    assert analysis.trigger == "incident-4"
    (culprit,) = analysis.culprits
    assert culprit.rank == 1
    last = culprit.last_collective
    assert last is not None
    assert (last.op, last.seq, last.group, last.state) == (
        "all_gather",
        41,
        "dp_shard",
        "completed",
    )
    assert culprit.stack is not None
    assert "examples/moe.py" in culprit.stack
    assert hang.root_cause.summary == "rank 1 never joined all_gather #42 on dp_shard: ranks 0 wait for it"
    assert hang.resume.reason == "step 70: the newest committed checkpoint"
    md = to_markdown(build(bundle, 4))
    assert "all_gather #41 on dp_shard (pg 1), completed at 2026-11-21 13:51:59.8 UTC" in md
    assert 'File "examples/moe.py", line 96, in route' in md


def test_whole_run_totals_stragglers_and_dumps(bundle: dict[str, Any]) -> None:
    report = build(bundle)
    assert [i.id for i in report.incidents] == [1, 2, 3, 4]
    assert [i.id for i in report.detailed] == [1, 4]
    totals = report.totals
    assert totals is not None
    assert (totals.interruptions, totals.straggler_warnings, totals.lost_steps) == (2, 2, 22)
    assert totals.by_kind == (("fatal_xid", 1), ("hang", 1))
    assert totals.downtime_s == pytest.approx(60.0)
    assert totals.detection_s == pytest.approx(21.7)
    assert [(s.rank, s.node, s.slowdown_ratio) for s in report.stragglers] == [(3, "node-2", 1.31), (1, "node-0", 1.25)]
    assert [d.trigger for d in report.dumps] == ["timeout-0-79"]  # incident-4's is in its incident's section
    assert dict(report.goodput.badput_s)["restart"] == pytest.approx(38.3)
    assert report.cordoned == (("node-1", "XID 79 on GPU 0: GPU has fallen off the bus"),)
    md = to_markdown(report)
    for heading in ("## Incidents", "## Incident 1: fatal GPU error (XID) on node-1", "## Incident 4: hang"):
        assert heading in md
    assert "| 4 | hang | node-0 | 1 | recovered |" in md
    assert "- **lost steps**: 22" in md


def test_single_incident_report_holds_that_incident_only(bundle: dict[str, Any]) -> None:
    one = build(bundle, 1)
    assert [i.id for i in one.incidents] == [1]
    assert one.totals is None
    assert one.dumps == ()
    md = to_markdown(one)
    assert "# Post-mortem of run demo, incident 1" in md
    assert "XID 79 (GPU has fallen off the bus) on GPU 0 of node-1" in md
    assert "Incident 4" not in md
    assert "## Incidents" not in md
    assert "never joined" not in md
    assert "| 2 | 2026-11-21 13:51:25.0 UTC | 3 | node-2 | 1.31x |" in md  # the run's straggler history
    assert "## Incident 4: hang" in to_markdown(build(bundle, 4))


def test_markdown_and_html_have_the_same_sections(bundle: dict[str, Any], run_html: str) -> None:
    md = to_markdown(build(bundle))
    titles = re.findall(r"^#+ (.*)$", md, flags=re.M)
    assert len(titles) >= 10
    assert re.findall(r"<h\d>(.*?)</h\d>", run_html) == titles


def test_open_incident_and_process_exit(bundle: dict[str, Any]) -> None:
    bundle["incidents"].append(
        {
            "id": 5,
            "key": "demo/gen3",
            "run": "demo",
            "kind": "process_exit",
            "node": "node-2",
            "rank": 2,
            "detail": "rank 2 exited with -9",
            "state": "open",
            "failed_s": 1795269220.0,
            "detected_s": 1795269221.5,
            "resumed_s": None,
            "resumed_from_step": None,
            "lost_steps": None,
            "spare": None,
        }
    )
    bundle["actions"].append(
        {"request_id": "incident-5-0-stop", "incident_id": 5, "run": "demo", "seq": 0, "kind": "stop"}
        | {"args": {"generation": 3}, "state": "pending", "created_s": 1795269221.6, "done_s": None, "result": None}
    )
    exit_ = incident(build(bundle), 5)
    assert exit_.root_cause.exit is not None
    assert (exit_.root_cause.exit.exit_code, exit_.root_cause.exit.signal_name) == (-9, "SIGKILL")
    assert exit_.root_cause.summary == "rank 2 on node-2 exited with -9 (SIGKILL)"
    assert exit_.downtime_s == pytest.approx(10.0)  # open: up to the bundle's time
    assert exit_.resume.step is None
    assert exit_.resume.reason == "not relaunched yet"
    assert [(p.name, p.end_s) for p in exit_.timeline[2:]] == [("stop", None), ("first step", None)]
    assert "down (failure to first productive step)**: 10.0 s so far" in to_markdown(build(bundle, 5))


def test_a_graceful_restarts_checkpoint_action_is_shown_as_the_controller_wrote_it(bundle: dict[str, Any]) -> None:
    checkpoint = {
        "request_id": "incident-1-9-checkpoint",
        "incident_id": 1,
        "run": "demo",
        "seq": -1,
        "kind": "checkpoint",
    }
    checkpoint |= {"args": {"at_step": 44}, "state": "done", "created_s": 1795269051.3, "done_s": 1795269051.3}
    bundle["actions"].append(checkpoint | {"result": {"checkpoint_step": None, "why": "no checkpoint store"}})
    assert incident(build(bundle), 1).timeline[2].detail == "checkpoint_step=None; why=no checkpoint store"
    bundle["actions"][-1]["result"] = {"checkpoint_step": 44, "asked_step": 44, "waited_s": 2.5}
    assert incident(build(bundle), 1).timeline[2].detail == "checkpoint_step=44; asked_step=44; waited_s=2.5"


@pytest.mark.parametrize(
    ("code", "name"), [(-9, "SIGKILL"), (-15, "SIGTERM"), (137, "SIGKILL"), (139, "SIGSEGV"), (1, None), (0, None)]
)
def test_signal_names(code: int, name: str | None) -> None:
    assert signal_name(code) == name


def test_resume_reason_from_the_checkpoints_without_skipped(bundle: dict[str, Any]) -> None:
    del bundle["actions"][3]["result"]["skipped"]
    xid = incident(build(bundle), 1)
    assert xid.resume.reason == "step 30: the newest, step 40, was torn: no manifest (the save did not finish)"
    # two unusable ones: both named, newest first
    bundle["checkpoints"].append({"step": 35, "state": "torn", "problem": "shard 3 size mismatch", "bytes": 10})
    bundle["incidents"][0]["resumed_from_step"] = 30
    assert incident(build(bundle), 1).resume.reason == (
        "step 30: the 2 newer ones were not usable: step 40 was torn: no manifest (the save did not finish); "
        "step 35 was torn: shard 3 size mismatch"
    )


def mutate(path: str, value: Any) -> Any:
    def apply(b: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target: Any = b
        for p in parents:
            target = target[int(p)] if p.isdigit() else target[p]
        if value is KeyError:
            del target[int(last) if last.isdigit() else last]
        else:
            target[int(last) if last.isdigit() else last] = value

    return apply


BAD_BUNDLES = {
    "no run": (mutate("run", KeyError), "Object missing required field `run`"),
    "no time": (mutate("generated_unix_s", KeyError), "Object missing required field `generated_unix_s`"),
    "a NaN time": (mutate("generated_unix_s", float("nan")), "Expected finite `float` - at `$.generated_unix_s`"),
    "a run without id": (mutate("run.id", KeyError), "Object missing required field `id` - at `$.run`"),
    "an empty run id": (mutate("run.id", ""), "Expected `str` of length >= 1 - at `$.run.id`"),
    "incidents not a list": (
        mutate("incidents", {"1": {}}),
        "Expected `array | null`, got `object` - at `$.incidents`",
    ),
    "a time that is a word": (
        mutate("incidents.0.failed_s", "yesterday"),
        "Expected `float`, got `str` - at `$.incidents[0].failed_s`",
    ),
    "an infinite time": (
        mutate("incidents.0.detected_s", float("inf")),
        "finite `float` - at `$.incidents[0].detected_s`",
    ),
    "a NaN time of an incident": (
        mutate("incidents.0.resumed_s", float("nan")),
        "Expected finite `float` - at `$.incidents[0].resumed_s`",
    ),
    "a fractional rank": (
        mutate("incidents.3.rank", 1.5),
        "Expected `int | null`, got `float` - at `$.incidents[3].rank`",
    ),
    "an incident without id": (mutate("incidents.2.id", KeyError), "missing required field `id` - at `$.incidents[2]`"),
    "an incident without kind": (
        mutate("incidents.1.kind", KeyError),
        "missing required field `kind` - at `$.incidents[1]`",
    ),
    "an action without kind": (mutate("actions.2.kind", KeyError), "missing required field `kind` - at `$.actions[2]`"),
    "a result that is a list": (mutate("actions.0.result", [1]), "got `array` - at `$.actions[0].result`"),
    "a skipped step that is a word": (
        mutate("actions.3.result.skipped.0.step", "forty"),
        "'launch' result does not fit: Expected `int`, got `str` - at `$.skipped[0].step` - at `$.actions[3]`",
    ),
    "a null checkpoint step": (
        mutate("checkpoints.0.step", None),
        "Expected `int`, got `null` - at `$.checkpoints[0].step`",
    ),
    "a checkpoint without step": (
        mutate("checkpoints.1.step", KeyError),
        "missing required field `step` - at `$.checkpoints[1]`",
    ),
    "a status that is a number": (mutate("status", 3), "Expected `object | null`, got `int` - at `$.status`"),
    "negative badput": (
        mutate("status.badput_s.restart", -3.0),
        "Expected `float` >= 0.0 - at `$.status.badput_s[...]`",
    ),
    "a culprit rank that is a word": (
        mutate("flight_recorder.incident-4.culprits.0.rank", "one"),
        "got `str` - at `$.flight_recorder[...].culprits[0].rank`",
    ),
}


@pytest.mark.parametrize(("change", "message"), BAD_BUNDLES.values(), ids=BAD_BUNDLES.keys())
def test_bad_bundles_are_refused_naming_the_field(bundle: dict[str, Any], change: Any, message: str) -> None:
    change(bundle)
    with pytest.raises(PermanentError, match=re.escape(message)) as refused:
        build(bundle)
    assert str(refused.value).startswith("post-mortem bundle: ")


@pytest.mark.parametrize("raw", [[], "bundle", None, 3])
def test_not_a_bundle_is_refused(raw: Any) -> None:
    with pytest.raises(PermanentError, match=r"^post-mortem bundle: Expected `object`, got `\w+`$"):
        build(raw)


def test_an_unknown_incident_is_refused(bundle: dict[str, Any]) -> None:
    with pytest.raises(PermanentError, match=r"run 'demo' has no incident 9 \(its incidents: 1, 2, 3, 4\)"):
        build(bundle, 9)


def test_strings_from_the_bundle_are_escaped(bundle: dict[str, Any]) -> None:
    evil = '<script>alert("x")</script>'
    hostile = copy.deepcopy(bundle)
    hostile["run"]["id"] = 'demo"><img src=x onerror=alert(1)>'
    hostile["incidents"][0]["node"] = evil
    hostile["incidents"][0]["detail"] = f"XID 79 on GPU 0: {evil}"
    hostile["incidents"][1]["node"] = "node$\\undefinedmacro$"  # mathtext would fail on it: drawn as it is
    hostile["flight_recorder"]["incident-4"]["culprits"][0]["stack"] = f"</pre>{evil}"
    report = build(hostile)
    page = to_html(report)
    assert "<script" not in page
    assert "<img src=x" not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page
    assert "&lt;/pre&gt;&lt;script&gt;" in page
    md = to_markdown(report)
    prose = re.sub(r"^```text\n.*?^```$", "", md, flags=re.S | re.M)  # code blocks show HTML as text
    assert not re.search(r"(?<!\\)<", prose)  # every "<" outside code blocks is escaped
    assert "</pre><script>" in md
    assert '\\<script\\>alert("x")\\</script\\>' in md


def test_html_is_self_contained(run_html: str) -> None:
    assert "<script" not in run_html.lower()
    assert not re.search(r"\b(href|action|srcset|poster)\s*=", run_html, flags=re.I)
    assert "url(" not in run_html
    assert "@import" not in run_html
    sources = re.findall(r'src="([^"]*)"', run_html)
    assert len(sources) == 4  # timeline, badput, stragglers, checkpoints
    for src in sources:
        assert src.startswith("data:image/png;base64,")
        image = Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1])))
        assert image.format == "PNG"
        assert image.size[0] >= 700
    assert "default-src 'none'" in run_html


def chromium_screenshot(page: Path, out: Path, profile: Path, size: tuple[int, int]) -> None:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        raise RuntimeError("chromium is not installed (make test installs the Debian package)")
    args = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run"]
    args += [f"--user-data-dir={profile}", "--force-device-scale-factor=1", f"--window-size={size[0]},{size[1]}"]
    args += [f"--screenshot={out}", page.as_uri()]
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "HOME": str(profile)},
    )
    try:
        output, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # chromium's own process group: its renderer and GPU processes too
        proc.communicate()
        raise
    assert proc.returncode == 0, output.decode(errors="replace")[-3000:]


def test_chromium_draws_the_page(tmp_path: Path, run_html: str) -> None:
    page = tmp_path / "postmortem.html"
    page.write_text(run_html)
    shot = tmp_path / "shot.png"
    chromium_screenshot(page, shot, tmp_path / "profile", (1200, 2400))
    image = Image.open(shot)
    assert image.format == "PNG"
    assert image.size == (1200, 2400)
    rgb = image.convert("RGB")
    counts = pixel_counts(rgb)
    assert len(counts) > 500  # text, tables and plots, not a blank page

    def near(target: tuple[int, int, int]) -> int:
        return sum(n for c, n in counts.items() if all(abs(a - b) <= 8 for a, b in zip(c, target, strict=True)))

    # the timeline plot at the top of the page: detection (orange) and relaunch (teal) bars
    assert near((0xE6, 0x7E, 0x22)) > 2000
    assert near((0x16, 0xA0, 0x85)) > 2000
    # the title's dark text and the red rule under it
    top = pixel_counts(rgb.crop((0, 0, 1200, 120)))
    assert sum(n for c, n in top.items() if max(c) < 80) > 200
    assert sum(n for c, n in top.items() if c[0] > 150 and c[1] < 90 and c[2] < 80) > 1000


def pixel_counts(rgb: Image.Image) -> dict[tuple[int, ...], int]:
    """How many pixels of each colour an RGB image has."""
    colours = rgb.getcolors(maxcolors=rgb.width * rgb.height)
    assert colours is not None
    return {c: n for n, c in colours if isinstance(c, tuple)}


def test_the_controllers_own_bundle_builds(tmp_path: Path) -> None:
    """The bundle as ``GET /v1/runs/{run}/postmortem`` makes it from a real state store, through JSON."""
    from opsd.controller.controller import Controller
    from opsd.controller.rows import LaunchSample
    from opsd.controller.state import StateStore
    from opsd.controller.views import postmortem_bundle

    t0 = 1_800_000_000.0
    store = StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}")
    store.create_run("job", RunSpec(min_nodes=2), t0)
    store.upsert_node("n1", t0 + 40, run="job", role="cordoned", reason="XID 48 on GPU 3: double-bit ECC error")
    ident, _ = store.open_incident(
        key="job/gen1",
        run="job",
        kind="fatal_xid",
        node="n1",
        rank=None,
        detail="XID 48 on GPU 3: double-bit ECC error",
        failed_s=t0 + 40,
        detected_s=t0 + 42.5,
    )
    steps: list[tuple[str, dict[str, Any]]] = [("stop", {"killed": 16}), ("cordon", {"node": "n1"})]
    steps.append(("take_spare", {"spare": "n9"}))
    steps.append(("launch", {"generation": 2, "nodes": ["n0", "n9"], "resumed_from_step": 100}))
    for seq, (kind, result) in enumerate(steps):
        store.record_action(
            f"incident-{ident}-{seq}-{kind}", run="job", incident_id=ident, seq=seq, kind=kind, args={}, now_s=t0 + 43
        )
        store.complete_action(f"incident-{ident}-{seq}-{kind}", t0 + 44 + seq, result)
    store.update_incident(ident, state="recovered", resumed_s=t0 + 70, resumed_from_step=100, lost_steps=7, spare="n9")
    store.upsert_node("n0", t0, run="job", role="active")
    store.record_launch("job", 1, t0 + 40, LaunchSample(ranks=16, comm={"forward;tp;all_reduce": 3.5}))
    store.update_run("job", t0 + 90, state="completed")
    bundle = json.loads(msgspec.json.encode(postmortem_bundle(Controller(store), "job", t0 + 100)))
    report = build(bundle, ident)
    (xid,) = report.incidents
    cause = xid.root_cause.xid
    assert cause is not None
    assert (cause.code, cause.gpu, cause.meaning) == (48, 3, "double-bit ECC error")
    assert xid.detection_delay_s == pytest.approx(2.5)
    assert xid.lost_steps == 7
    assert [p.name for p in xid.timeline][-3:] == ["swap", "relaunch", "first step"]
    assert xid.resume.reason == "step 100: the newest committed checkpoint"
    assert xid.collectives == (("forward;tp;all_reduce", 3.5),)  # of launch 1, the one that failed
    mtbf = report.goodput.mtbf
    assert (mtbf.failures, mtbf.nodes) == (1, 1)  # a finished run: its nodes from the store
    assert mtbf.node_hours == pytest.approx(90 / 3600)  # until it ended, not until the bundle was made
    assert "double-bit ECC error" in to_markdown(report)


def test_a_finished_run_shows_its_mtbf_inputs_last_figures_and_the_failed_launchs_collectives(
    bundle: dict[str, Any],
) -> None:
    bundle["status"].update(
        mfu_ratio=0.0,
        tokens_per_s=0.0,
        last_measured={"launch": 3, "mfu_ratio": 0.412, "tokens_per_s": 51234.0, "at_unix_s": 1.0},
        run_average={"mfu_ratio": 0.398, "tokens_per_s": 49000.0, "samples": 40},
    )
    bundle["mtbf"] = {
        "mtbf_s": 36_000.0,
        "node_mtbf_h": 20.0,
        "failures": 3,
        "node_hours": 57.5,
        "nodes": 2,
        "prior": {"node_mtbf_h": 5000.0, "node_hours": 50000.0},
    }
    bundle["launches"] = [
        {"generation": 1, "comm": {"backward;dp_shard;reduce_scatter": 12.5, "forward;tp;all_reduce": 30.25}},
        {"generation": 2, "comm": {"forward;tp;all_reduce": 1.0}},
    ]
    report = build(bundle)
    xid = incident(report, 1)  # key demo/gen1
    assert xid.launch == 1
    assert xid.collectives == (("forward;tp;all_reduce", 30.25), ("backward;dp_shard;reduce_scatter", 12.5))
    assert incident(report, 2).collectives == ()  # a straggler warning belongs to no failed launch
    md = to_markdown(report)
    mtbf = "10 h 00 min (3 failures in 57.5 node-hours; 2 nodes; a node MTBF of 20 h; prior: 5,000 h per node"
    assert mtbf in md
    assert "0.412 (last measured, launch 3); run average 0.398" in md
    assert "51,234 (last measured, launch 3); run average 49,000" in md
    assert "Where launch 1's collective time went" in md
    assert "forward / tp / all_reduce" in md
    assert "?" not in md.split("MTBF", 1)[1].split("\n", 1)[0]


def test_an_older_bundle_without_the_mtbf_inputs_still_builds(bundle: dict[str, Any]) -> None:
    assert "mtbf" not in bundle
    report = build(bundle)
    assert report.goodput.mtbf.mtbf_s == bundle["status"]["mtbf_s"]
    assert report.goodput.mtbf.failures is None


def test_the_docs_examples_are_what_it_writes(bundle: dict[str, Any]) -> None:
    text = (Path(__file__).parents[1] / "docs" / "postmortem.md").read_text()
    first, second = re.findall(r"^```markdown\n(.*?)^```", text, flags=re.S | re.M)
    for excerpt, ident in ((first, 1), (second, 4)):
        md = to_markdown(build(bundle, ident))
        for block in excerpt.strip().split("\n\n"):  # excerpts: some blocks left out
            assert block in md


def test_a_run_without_incidents_or_status(bundle: dict[str, Any]) -> None:
    bundle.update(incidents=[], actions=[], checkpoints=[], flight_recorder={}, status=None)
    report = build(bundle)
    assert report.totals is not None
    assert (report.totals.interruptions, report.goodput.ettr, report.goodput.badput_s) == (0, None, ())
    md = to_markdown(report)
    assert "No incidents." in md
    assert "No straggler warnings." in md
    assert "No checkpoints." in md
    assert "<img" not in to_html(report)  # nothing to plot


def test_a_finished_pipelined_run_keeps_its_last_bubble_for_status_and_post_mortem(tmp_path: Path) -> None:
    """The ranks are gone once the run ends: the bubble recorded with its launches is what status and the
    post-mortem show, labelled with its launch, with the run's average beside it."""
    from opsd.cli.tables import status_table
    from opsd.controller.controller import Controller
    from opsd.controller.rows import LaunchSample
    from opsd.controller.state import StateStore
    from opsd.controller.views import postmortem_bundle
    from opsd.protocol.answers import PipelineBubble
    from tests.test_cli_tables import render as render_table

    def piped(bubble: float) -> PipelineBubble:
        return PipelineBubble(
            bubble_ratio=bubble,
            theoretical_ratio=0.273,
            margin_ratio=0.1,
            over_theory=bubble - 0.273 > 0.1,
            schedule="1f1b",
            stages=4,
            microbatches=8,
            stage_ratios={"0": bubble},
        )

    t0 = 1_800_000_000.0
    store = StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}")
    store.create_run("job", RunSpec(min_nodes=2), t0)
    sample = LaunchSample(ranks=8, progressed=True, mfu_ratio=0.4, tokens_per_s=1000.0)
    store.record_launch("job", 1, t0 + 10, replace(sample, pipeline=piped(0.30)))
    store.record_launch("job", 1, t0 + 20, replace(sample, pipeline=piped(0.32)))
    store.record_launch("job", 2, t0 + 40, replace(sample, pipeline=piped(0.40)))
    store.record_launch("job", 2, t0 + 50, replace(sample, progressed=False, pipeline=piped(0.90)))  # not counted
    store.update_run("job", t0 + 60, state="completed")
    controller = Controller(store)

    status = controller.status("job", t0 + 70)
    assert status is not None
    assert status.pipeline is None  # no rank reports any more
    assert status.last_measured is not None
    assert status.run_average is not None
    assert status.last_measured.pipeline == piped(0.40)
    assert status.last_measured.pipeline_launch == 2
    assert status.run_average.bubble_ratio == pytest.approx((0.30 + 0.32 + 0.40) / 3)
    shown = render_table(status_table(status), 200)
    assert "0.40 measured, theory 0.27 (1f1b, 4 stages x 8 micro-batches), 0.13 over" in shown
    assert "(last measured, launch 2)" in shown

    report = build(json.loads(msgspec.json.encode(postmortem_bundle(controller, "job", t0 + 70))))
    pipeline = report.goodput.pipeline
    assert pipeline is not None
    assert (pipeline.bubble_ratio, pipeline.launch, pipeline.stages) == (0.40, 2, 4)
    expected = "0.40 (last measured, launch 2), theory 0.27 for 1f1b, 4 stages x 8 micro-batches; run average 0.34"
    assert expected in to_markdown(report)

    store.create_run("flat", RunSpec(min_nodes=1), t0)
    store.record_launch("flat", 1, t0 + 10, sample)
    flat = build(json.loads(msgspec.json.encode(postmortem_bundle(controller, "flat", t0 + 20))))
    assert flat.goodput.pipeline is None
    assert "pipeline bubble" not in to_markdown(flat)


def test_a_live_bubble_in_the_bundle_is_shown_without_a_launch(bundle: dict[str, Any]) -> None:
    bundle["status"]["pipeline"] = {"bubble_ratio": 0.2, "theoretical_ratio": None, "schedule": "gpipe"}
    md = to_markdown(build(bundle))
    assert "- **pipeline bubble**: 0.20\n" in md  # live, no theory (an interleaved schedule has none)
    bundle["status"]["pipeline"] = {"bubble_ratio": "high"}
    with pytest.raises(PermanentError, match=r"status\.pipeline\.bubble_ratio"):
        build(bundle)
