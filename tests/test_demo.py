"""`make demo` as a test: an XID 79 on a node of a running job is detected within 5 s, the node is swapped for the
spare, the ranks resume from the newest committed checkpoint within 60 s of the injection, the run completes, and
its final weights equal those of a run that was never interrupted.

A real Prometheus scrapes the demo's controller and agents while it runs (file-based discovery: each target is
added as its port appears, an agent's with its ``node`` label, ``honor_labels`` on, as docs/dashboards.md asks of
a production scrape config); afterwards every query of every panel of every dashboard, its variables substituted,
must return data over the run's time span. Its controller and agents export their spans over OTLP/HTTP into a local
receiver (``OTEL_EXPORTER_OTLP_ENDPOINT``): the XID's incident is one trace of its recovery steps."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from bench.measured_costs import demo_costs
from opsd.backends.local.processes import free_port
from opsd.cli.app import app
from opsd.cli.demo import RUN, trainer_command
from opsd.controller.controller import Controller
from opsd.controller.state import StateStore
from opsd.dashboards.build import build_all, panel_queries, variable_queries
from opsd.postmortem.model import seconds
from tests.launch import ROOT, run_module
from tests.otlp import OtlpReceiver, ReceivedSpan
from tests.prometheus import PrometheusServer, ScrapeTargets
from tests.serving import start_api

pytestmark = pytest.mark.slow

SCRAPE_INTERVAL_S = 1.0
RATE_INTERVAL = "5s"  # what Grafana's $__rate_interval is at this scrape interval (at least 4 scrapes)
FLAGGED_ONLY = "opsd_run_straggler_slowdown_ratio"  # a series the controller exports for flagged ranks only
PIPELINE_ONLY = "pipeline_bubble"  # series of pipeline ranks and runs only (test_pipeline_bubble.py measures them)
FT_ONLY = "replica_groups"  # series of fault-tolerant runs only (make demo-ft)


@dataclass
class PanelResult:
    dashboard: str
    title: str
    expr: str
    series: int = 0
    samples: int = 0
    error: str = ""


@dataclass
class Demo:
    returncode: int
    stdout: str
    stderr: str
    work: Path
    panels: list[PanelResult] = field(default_factory=list)
    variables: dict[tuple[str, str], list[str]] = field(default_factory=dict)  # (dashboard, variable) -> values
    stragglers_flagged: bool = False
    pipelined: bool = False  # a rank reported a pipeline bubble
    spans: list[ReceivedSpan] = field(default_factory=list)  # what its controller and agents exported

    @property
    def result(self) -> dict[str, Any]:
        parsed: dict[str, Any] = json.loads(self.stdout.strip().splitlines()[-1])
        return parsed


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


LABEL_VALUES = re.compile(r"^label_values\((.+),\s*(\w+)\)$")


def run_variable_queries(prom: PrometheusServer, start_s: float, end_s: float) -> dict[tuple[str, str], list[str]]:
    """The values each query variable offers (Grafana's ``label_values(selector, label)``: Prometheus' label values
    API over the time range), the run chosen and All for the others."""
    found = {}
    for name, board in build_all().items():
        for variable, query in variable_queries(board, {"run": RUN}):
            m = LABEL_VALUES.match(query)
            assert m, f"{name}: variable {variable}: {query!r} is not label_values(selector, label)"
            found[name, variable] = sorted(prom.label_values(m.group(2), m.group(1), start_s, end_s))
    return found


def run_panel_queries(prom: PrometheusServer, start_s: float, end_s: float) -> list[PanelResult]:
    results = []
    for name, board in build_all().items():
        for title, expr in panel_queries(board, {"run": RUN}, interval=RATE_INTERVAL):
            r = PanelResult(name, title, expr)
            try:
                series = prom.query_range(expr, start_s, end_s, step_s=2.0)
            except (RuntimeError, OSError) as exc:
                r.error = str(exc)
            else:
                r.series = len(series)
                r.samples = sum(len(s.get("values", [])) for s in series)
            results.append(r)
    return results


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Demo:
    """The demo, run once, scraped by a real Prometheus; the panels' queries are run right after it."""
    tmp = tmp_path_factory.mktemp("demo")
    work, prom_dir = tmp / "demo", tmp / "prometheus"
    prom_dir.mkdir()
    stdout, stderr = tmp / "demo.out", tmp / "demo.err"
    targets = prom_dir / "targets.json"
    with (
        PrometheusServer(
            prom_dir,
            targets=[],
            scrape_interval_s=SCRAPE_INTERVAL_S,
            file_sd=targets,
            credentials_file=work / "state" / "token",  # the demo controller's token: its /metrics wants it
        ) as prom,
        OtlpReceiver() as otlp,
    ):
        started = time.time()
        with stdout.open("wb") as out, stderr.open("wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "opsd.cli.demo", "--workdir", str(work), "--steps", "80"],
                cwd=ROOT,
                stdout=out,
                stderr=err,
                env={**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.url},
            )
        with ScrapeTargets(stdout, work / "runs" / RUN / "nodes", targets):
            try:
                returncode = proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                proc.kill()
                returncode = proc.wait()
        ended = time.time()
        run = Demo(returncode, _read(stdout), _read(stderr), work, spans=otlp.spans())
        if returncode == 0:
            prom.wait_for_scrapes_after(ended)  # every sample of the run in
            run.panels = run_panel_queries(prom, started, ended)
            run.variables = run_variable_queries(prom, started, ended)
            flagged = prom.query_range(f'max(opsd_run_stragglers{{run="{RUN}"}})', started, ended, 2.0)
            run.stragglers_flagged = any(float(v) > 0 for s in flagged for _, v in s["values"])
            run.pipelined = bool(prom.query_range(f'opsd_pipeline_bubble_ratio{{run="{RUN}"}}', started, ended, 2.0))
    return run


def test_the_demo_recovers_and_ends_with_the_weights_of_an_uninterrupted_run(demo: Demo, tmp_path: Path) -> None:
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    result = demo.result
    assert result["state"] == "completed"
    assert result["incident"] == "fatal_xid"
    assert 0 <= result["detected_s"] <= 5.0
    assert result["recovered_s"] <= 60.0
    assert (result["nodes_swapped"], result["spare"]) == (1, "node-2")
    assert result["resumed_from_step"] >= 20  # the injection came after the checkpoint of step 20 was committed
    assert 0 < result["lost_steps"] <= 10  # at most the steps since that checkpoint (one is saved every 10)
    assert result["final_step"] == 80
    assert 0 < result["ettr"] < 1
    interrupted = json.loads((demo.work / "losses.json").read_text())
    assert interrupted["resumed_from_step"] == result["resumed_from_step"]

    # the same job, never interrupted: torchrun, 4 ranks
    out = tmp_path / "straight.json"
    command = trainer_command(f"file://{tmp_path / 'straight-ckpt'}", 80, out)
    straight = run_module(command[2], command[3:], nproc=4)
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert json.loads(out.read_text())["state_hashes"] == interrupted["state_hashes"]


def test_every_panel_of_every_dashboard_returns_data_from_the_demo(demo: Demo) -> None:
    assert demo.returncode == 0, "the demo failed: see the test above"
    assert len(demo.panels) == sum(len(p["targets"]) for b in build_all().values() for p in b["panels"])
    failures = []
    for r in demo.panels:
        where = f"{r.dashboard} / {r.title}: {r.expr}"
        if r.error:
            failures.append(f"{where}: {r.error}")
        elif PIPELINE_ONLY in r.expr and not demo.pipelined:
            if r.samples:  # the demo's mesh has no pipeline: the bubble series must not exist
                failures.append(f"{where}: {r.series} series although the demo runs no pipeline")
        elif FT_ONLY in r.expr:
            if r.samples:  # the demo's run has no replica groups: the quorum's series must not exist
                failures.append(f"{where}: {r.series} series although the demo's run has no replica groups")
        elif FLAGGED_ONLY in r.expr and not demo.stragglers_flagged:
            if r.samples:  # no rank flagged during the demo: the series must not exist
                failures.append(f"{where}: {r.series} series although opsd_run_stragglers stayed 0")
        elif not r.samples:
            failures.append(f"{where}: no data")
    assert not failures, f"{len(failures)} of {len(demo.panels)} panel queries failed:\n" + "\n".join(failures)


def test_the_dashboards_variables_list_the_demos_run_nodes_and_ranks(demo: Demo) -> None:
    assert demo.returncode == 0, "the demo failed: see the first test"
    expected = {"run": [RUN], "node": ["node-0", "node-1", "node-2"], "rank": ["0", "1", "2", "3"]}
    assert demo.variables, "no variable was queried"
    for (name, variable), values in demo.variables.items():
        assert values == expected[variable], (name, variable, values)


def test_the_post_mortem_of_the_demos_xid_names_node_gpu_meaning_delay_lost_steps_and_resume(demo: Demo) -> None:
    """After the demo, its state store served by a controller again, and read through the CLI."""
    assert demo.returncode == 0, "the demo failed: see the first test"
    result = demo.result
    state = demo.work / "state"
    controller = Controller(StateStore.open(f"sqlite:///{state / 'opsd.db'}"))
    port = free_port()
    server = start_api(controller, "demo-reader", "127.0.0.1", port)
    try:
        url = f"http://127.0.0.1:{port}"  # start_api returns once it listens
        (incident,) = [i for i in controller.store.incidents(RUN) if i.kind == "fatal_xid"]
        runner = CliRunner()
        md = runner.invoke(app, ["postmortem", RUN, str(incident.id), "--url", url, "--token", "demo-reader"])
        assert md.exit_code == 0, md.output
        text = md.stdout
        assert "XID 79 (GPU has fallen off the bus) on GPU 0 of node-1" in text
        assert "took spare node-2" in text
        delay_s = incident.detected_s - incident.failed_s
        assert 0 < delay_s <= 5.0  # from the agent's time of the XID event to its incident
        assert f"**detection delay**: {seconds(delay_s)}" in text
        assert f"**lost steps**: {result['lost_steps']}" in text
        assert f"step {result['resumed_from_step']}" in text.split("### Resumed from")[1]
        page = demo.work / "postmortem.html"
        html = runner.invoke(
            app, ["postmortem", RUN, "--format", "html", "--out", str(page), "--url", url, "--token", "demo-reader"]
        )
        assert html.exit_code == 0, html.output
        assert page.read_text().count("data:image/png;base64,") >= 2
        listed = runner.invoke(app, ["checkpoints", RUN, "--json", "--url", url, "--token", "demo-reader"])
        committed = [c for c in json.loads(listed.stdout)["checkpoints"] if c["state"] == "committed"]
        assert committed[0]["step"] == result["final_step"]  # newest first; the older ones retired
    finally:
        server.should_exit = True


def test_the_demo_gives_bench_goodput_its_detection_and_relaunch_seconds(demo: Demo) -> None:
    """What ``bench.goodput --measure`` reads of a demo: the three delays add up to the demo's own figures."""
    assert demo.returncode == 0, "the demo failed: see the first test"
    costs = demo_costs(demo.work)
    result = demo.result
    assert 0 < costs["xid_detection_s"] <= 5.0
    assert 0 < costs["controller_steps_s"] < costs["rank_startup_s"]
    # the demo counts from the injection, the incident from the agent's time of the XID: a few ms apart
    total = costs["xid_detection_s"] + costs["controller_steps_s"] + costs["rank_startup_s"]
    assert total == pytest.approx(result["recovered_s"], abs=0.5)


def test_the_demos_incident_is_one_trace_of_its_recovery_steps_linked_to_the_xid(demo: Demo) -> None:
    """One trace for the XID's incident (its id printed and in the state store): the root from detection to the
    first productive step, linked to node-1's agent's span of the XID, and the recovery steps in order, each after
    the one before, their durations adding up to the recovery time."""
    assert demo.returncode == 0, "the demo failed: see the first test"
    trace_id = demo.result["trace_id"]
    assert re.fullmatch(r"[0-9a-f]{32}", trace_id or ""), demo.result
    assert f"trace id {trace_id}" in demo.stdout
    store = StateStore.open(f"sqlite:///{demo.work / 'state' / 'opsd.db'}")
    (incident,) = [i for i in store.incidents(RUN) if i.kind == "fatal_xid"]
    assert incident.trace_id == trace_id
    controller = [s for s in demo.spans if s.service == "opsd-controller"]
    assert {s.trace_id for s in controller} == {trace_id}  # the one incident, one trace
    root, *steps = sorted(controller, key=lambda s: (s.start_ns, -s.end_ns))
    assert [root.name, *(s.name for s in steps)] == [
        "incident",
        "quarantine",
        "promote_spare",
        "stop",
        "relaunch",
        "resume",
    ]
    assert all(s.parent_span_id == root.span_id for s in steps)
    assert incident.resumed_s is not None
    assert (root.start_ns, root.end_ns) == (int(incident.detected_s * 1e9), int(incident.resumed_s * 1e9))
    recovery_s = incident.resumed_s - incident.detected_s
    assert sum(s.duration_s for s in steps) == pytest.approx(recovery_s, abs=1e-5)
    assert all(a.end_ns == b.start_ns for a, b in itertools.pairwise(steps))
    assert (root.attributes["opsd.node"], root.attributes["opsd.spare"]) == ("node-1", "node-2")
    assert steps[1].attributes["opsd.spare"] == "node-2"
    assert [s.attributes["opsd.request_id"] for s in steps[:-1]] == [
        a.request_id for a in store.actions(incident_id=incident.id)
    ]
    (xid,) = [s for s in demo.spans if s.service == "opsd-agent" and s.name == "gpu.xid"]
    assert xid.attributes["gpu.xid"] == 79
    assert [(t, s) for t, s, _ in root.links] == [(xid.trace_id, xid.span_id)]
    store.engine.dispose()


def test_the_demo_fails_when_no_fault_is_injected(tmp_path: Path) -> None:
    """``--no-inject``: the run completes, but nothing was detected or recovered from, so the demo exits 1 and says
    why (as few steps as the run needs: nothing is injected)."""
    options = ["--workdir", str(tmp_path / "demo"), "--steps", "2", "--timeout-s", "240", "--no-inject"]
    proc = subprocess.run(
        [sys.executable, "-m", "opsd.cli.demo", *options],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,  # within pytest's 300 s: the demo's own report when it runs out of time
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (result["state"], result["final_step"]) == ("completed", 2), proc.stderr[-3000:]
    assert "opsd demo failed: no fault was injected" in proc.stderr.splitlines()
