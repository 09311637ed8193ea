"""The Grafana dashboards and the alert rules: the committed files are valid and what the code generates, the rules
pass ``promtool check rules`` and their unit tests, ``validate`` catches what it should, and ``opsd dashboards push``
talks to a Grafana API (a small real HTTP server here) as Grafana expects. That every panel's query returns data
from a real run is checked by the demo test (tests/test_demo.py)."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from opsd.backends.local.processes import free_port
from opsd.cli.app import app
from opsd.dashboards import build as dashboards
from opsd.dashboards.widgets import SCHEMA_VERSION
from tests.launch import ROOT

DIR = ROOT / "dashboards"
RULES = DIR / "rules"
FILES = ["training", "communication", "stragglers", "reliability", "gpu-health"]
ALERTS = {
    "OpsdMfuDrop",
    "OpsdStragglerFlagged",
    "OpsdAgentDown",
    "OpsdPipelineBubbleAboveTheory",
    "OpsdNoStepProgress",
    "OpsdSparePoolEmpty",
    "OpsdSparePoolShort",
    "OpsdCheckpointStale",
    "OpsdFatalXid",
}


def committed() -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(DIR.glob("*.json"))}


# -- the dashboards ------------------------------------------------------------------------------------------------
def test_committed_dashboards_are_valid_and_complete() -> None:
    boards = committed()
    assert sorted(boards) == sorted(FILES)
    assert dashboards.validate(list(boards.values())) == []
    assert len({b["uid"] for b in boards.values()}) == len(FILES)
    for name, board in boards.items():
        assert board["schemaVersion"] == SCHEMA_VERSION == 41
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        assert variables["run"]["query"].startswith("label_values(")
        kinds = {p["type"] for p in board["panels"]}
        assert kinds <= {"timeseries", "stat", "heatmap", "table"}, name
        for p in board["panels"]:
            grid = p["gridPos"]
            assert grid["x"] + grid["w"] <= 24, p["title"]
            for t in p["targets"]:
                assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
                assert '$run"' in t["expr"] or "$node" in t["expr"], (name, p["title"], t["expr"])
    assert {v["name"] for v in boards["training"]["templating"]["list"]} == {"datasource", "run", "node", "rank"}
    assert next(p for p in boards["stragglers"]["panels"] if p["type"] == "heatmap")


def test_committed_dashboards_are_what_the_code_generates(tmp_path: Path) -> None:
    assert dashboards.main(["write", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{n}.json" for n in FILES)
    for path in tmp_path.iterdir():
        assert path.read_text() == (DIR / path.name).read_text(), (
            f"run: python -m opsd.dashboards write dashboards ({path.name})"
        )
    assert dashboards.main(["check", str(DIR)]) == 0
    (tmp_path / "training.json").write_text("{}")
    assert dashboards.check(tmp_path) == [f"{tmp_path / 'training'}.json"]


def test_validate_catches_a_dangling_variable_an_unused_one_and_a_foreign_datasource() -> None:
    board = copy.deepcopy(dashboards.build_all()["training"])
    board["panels"][0]["targets"][0]["expr"] = 'opsd_run_mfu_ratio{run="$run", cluster="$cluster"}'
    board["panels"][1]["targets"][0]["datasource"] = {"type": "prometheus", "uid": "P1809F7CD0C75ACF3"}
    board["templating"]["list"].append(_variable("gpu"))
    problems = dashboards.validate(board)
    assert any("$cluster" in p and "no variable defines" in p for p in problems), problems
    assert any("'gpu' is not used" in p for p in problems), problems
    assert any("Tokens per second now" in p and "datasource variable" in p for p in problems), problems
    assert len(problems) == 3, problems


def test_validate_catches_a_duplicate_uid_and_duplicate_panel_ids() -> None:
    built = dashboards.build_all()
    twin = copy.deepcopy(built["stragglers"])
    twin["title"] = "opsd / Stragglers again"
    problems = dashboards.validate([built["stragglers"], twin])
    assert any("uid 'opsd-stragglers' is also used" in p for p in problems), problems
    assert any("panel id 300 is also used" in p for p in problems), problems
    one = copy.deepcopy(built["reliability"])
    one["panels"][1]["id"] = one["panels"][0]["id"]
    one["panels"][2]["title"] = ""
    problems = dashboards.validate(one)
    assert any(f"panel id {one['panels'][0]['id']} is used more than once" in p for p in problems), problems
    assert any("has no title" in p for p in problems), problems
    assert dashboards.validate(list(built.values())) == []


def _variable(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {"query": f'label_values(opsd_gpu_power_watts{{node=~"$node"}}, {name})'},
        "multi": True,
        "includeAll": True,
    }


def test_panel_queries_substitute_variables_as_grafana_does() -> None:
    board = dashboards.build_all()["communication"]
    queries = dashboards.panel_queries(board, {"run": "llama-70b", "node": "All", "rank": "0,1"}, interval="30s")
    assert len(queries) == sum(len(p["targets"]) for p in board["panels"])
    for title, expr in queries:
        assert "$" not in expr, (title, expr)
        assert "[[" not in expr, (title, expr)
    title, expr = queries[0]
    assert title == "Time in collectives by dimension and op (mean over ranks)"
    assert expr == (
        'avg by (dimension, op) (rate(opsd_collective_seconds_total{run="llama-70b", node=~".*", rank=~"(0|1)"}[30s]))'
    )
    single = dashboards.panel_queries(board, {"run": "a.b", "node": "node-1.rack2", "rank": "All"})
    assert 'run="a.b", node=~"node-1\\\\.rack2", rank=~".*"' in single[0][1]
    with pytest.raises(ValueError, match="run"):
        dashboards.panel_queries(board, {"node": "All"})
    with pytest.raises(ValueError, match="cluster"):
        dashboards.panel_queries(board, {"run": "a", "cluster": "x"})


# -- the alert rules -----------------------------------------------------------------------------------------------
def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    assert binary is not None, "promtool is not installed (make test installs Debian's prometheus)"
    return subprocess.run([binary, *args], cwd=RULES, capture_output=True, text=True, timeout=60)


def test_promtool_checks_the_rules_and_their_unit_tests_pass() -> None:
    checked = promtool("check", "rules", "opsd.rules.yaml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 9 rules found" in checked.stdout
    tested = promtool("test", "rules", "opsd.rules.test.yaml")
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_every_alert_has_labels_annotations_and_a_firing_and_a_silent_unit_test() -> None:
    (group,) = yaml.safe_load((RULES / "opsd.rules.yaml").read_text())["groups"]
    assert group["name"] == "opsd"
    rules = {r["alert"]: r for r in group["rules"]}
    assert set(rules) == ALERTS
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert "$labels." in rule["annotations"]["summary"], name
        assert "$labels." in rule["annotations"]["description"], name
    cases = [
        c for t in yaml.safe_load((RULES / "opsd.rules.test.yaml").read_text())["tests"] for c in t["alert_rule_test"]
    ]
    fires = {c["alertname"] for c in cases if c["exp_alerts"]}
    silent = {c["alertname"] for c in cases if not c["exp_alerts"]}
    assert fires == ALERTS
    assert silent == ALERTS


def test_a_broken_rule_fails_its_unit_test(tmp_path: Path) -> None:
    """The unit tests are not vacuous: with the stale-checkpoint threshold at 1x the interval instead of 2x, and
    with the fatal-XID rule matching any action, they fail."""
    rules = (RULES / "opsd.rules.yaml").read_text()
    broken = rules.replace(
        "> on (run) 2 * opsd_run_checkpoint_interval_seconds", "> on (run) opsd_run_checkpoint_interval_seconds"
    )
    assert broken.count('{action="cordon_and_swap"}') == 3
    broken = broken.replace('{action="cordon_and_swap"}', "")
    (tmp_path / "opsd.rules.yaml").write_text(broken)
    shutil.copy(RULES / "opsd.rules.test.yaml", tmp_path)
    binary = shutil.which("promtool")
    assert binary is not None
    proc = subprocess.run(
        [binary, "test", "rules", "opsd.rules.test.yaml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode != 0
    assert "alertname: OpsdCheckpointStale" in proc.stderr
    assert 'action="restart_job", alertname="OpsdFatalXid"' in proc.stderr


# -- opsd dashboards push ------------------------------------------------------------------------------------------
class FakeGrafana:
    """Grafana's HTTP API on loopback, the calls ``opsd dashboards push`` makes, answering as Grafana 10/11 does:
    ``GET /api/folders`` (a list of {id, uid, title}), ``POST /api/folders`` ({title} -> the folder; 409 when the
    title is taken), ``POST /api/dashboards/db`` ({dashboard, folderUid or folderId, overwrite} -> {id, uid, url,
    status, version, slug}; 400 without a title, 400 for an unknown folder, 412 for an existing uid without
    overwrite, 404 for an id that is not there). Every call needs ``Authorization: Bearer <token>`` (401 without).
    Requests are recorded; once ``fail_after`` dashboards are saved, the dashboard calls answer 500."""

    def __init__(self, token: str, prefix: str = "") -> None:
        self.token = token
        self.prefix = prefix
        self.requests: list[dict[str, Any]] = []
        self.folders: list[dict[str, Any]] = [{"id": 1, "uid": "general-ish", "title": "Existing"}]
        self.boards: dict[str, dict[str, Any]] = {}
        self.fail_after: int | None = None
        self.saved = 0
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}{prefix}"

    def __enter__(self) -> FakeGrafana:
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def answer(self, method: str, path: str, headers: dict[str, str], body: Any) -> tuple[int, Any]:
        with self.lock:
            self.requests.append({"method": method, "path": path, "auth": headers.get("authorization"), "body": body})
            if not path.startswith(self.prefix + "/api/"):
                return 404, {"message": "Not found"}
            path = path.removeprefix(self.prefix)
            if headers.get("authorization") != f"Bearer {self.token}":
                return 401, {"message": "invalid API key"}
            if (method, path) == ("GET", "/api/folders"):
                return 200, self.folders
            if (method, path) == ("POST", "/api/folders"):
                if not isinstance(body, dict) or not body.get("title"):
                    return 400, {"message": "folder title cannot be empty"}
                if any(f["title"] == body["title"] for f in self.folders):
                    return 409, {
                        "message": "a folder or dashboard in the general folder with the same name already exists"
                    }
                folder = {"id": len(self.folders) + 1, "uid": f"f{len(self.folders) + 1}x", "title": body["title"]}
                self.folders.append(folder)
                return 200, {**folder, "url": f"/dashboards/f/{folder['uid']}/", "version": 1}
            if (method, path) == ("POST", "/api/dashboards/db"):
                if self.fail_after is not None and self.saved >= self.fail_after:
                    return 500, {"message": "Internal Server Error"}
                board = body.get("dashboard") if isinstance(body, dict) else None
                if not isinstance(board, dict) or not board.get("title"):
                    return 400, {"message": "Dashboard title cannot be empty"}
                folder_uid = body.get("folderUid") or ""
                if folder_uid and not any(f["uid"] == folder_uid for f in self.folders):
                    return 400, {"message": "folder not found"}
                if board.get("id") is not None and not any(b["id"] == board["id"] for b in self.boards.values()):
                    return 404, {"message": "Dashboard not found"}
                uid = board.get("uid") or f"gen{len(self.boards)}"
                if uid in self.boards and not body.get("overwrite"):
                    return 412, {"message": "A dashboard with the same uid already exists", "status": "name-exists"}
                previous = self.boards.get(uid)
                stored = {"id": previous["id"] if previous else len(self.boards) + 1, "uid": uid, "folder": folder_uid}
                stored["version"] = previous["version"] + 1 if previous else 1
                self.boards[uid] = stored
                self.saved += 1
                slug = board["title"].lower().replace(" ", "-").replace("/", "")
                return 200, {
                    "id": stored["id"],
                    "uid": uid,
                    "url": f"/d/{uid}/{slug}",
                    "status": "success",
                    "version": stored["version"],
                    "slug": slug,
                }
            return 404, {"message": "Not found"}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        grafana = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = raw.decode(errors="replace")
                headers = {k.lower(): v for k, v in self.headers.items()}
                status, reply = grafana.answer(self.command, self.path, headers, body)
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _serve  # noqa: N815 - http.server's names

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler


@pytest.fixture
def grafana() -> Iterator[FakeGrafana]:
    with FakeGrafana("s3cret", prefix="/grafana") as g:
        yield g


def push(url: str, *extra: str, token: str = "s3cret") -> Any:
    args = ["dashboards", "push", "--grafana-url", url, "--token", token, "--dir", str(DIR), *extra]
    return CliRunner().invoke(app, args)


def test_push_creates_the_folder_and_posts_every_dashboard_with_overwrite(grafana: FakeGrafana) -> None:
    result = push(grafana.url, "--folder", "ML training")
    assert result.exit_code == 0, result.output
    assert "5 dashboards pushed to folder 'ML training'" in result.output
    calls = [(r["method"], r["path"]) for r in grafana.requests]
    assert (
        calls
        == [("GET", "/grafana/api/folders"), ("POST", "/grafana/api/folders")]
        + [("POST", "/grafana/api/dashboards/db")] * 5
    )
    assert {r["auth"] for r in grafana.requests} == {"Bearer s3cret"}
    assert grafana.requests[1]["body"] == {"title": "ML training"}
    folder = grafana.folders[-1]
    files = committed()
    posted = [r["body"] for r in grafana.requests[2:]]
    assert sorted(b["dashboard"]["uid"] for b in posted) == sorted(b["uid"] for b in files.values())
    for body in posted:
        assert body["overwrite"] is True
        assert (body["folderUid"], body["folderId"]) == (folder["uid"], folder["id"])
        assert body["dashboard"]["id"] is None
        original = next(b for b in files.values() if b["uid"] == body["dashboard"]["uid"])
        assert {k: v for k, v in body["dashboard"].items() if k != "id"} == original
    assert "/d/opsd-training/" in result.output

    # again: the folder is found, not created, and every dashboard replaced (version 2)
    grafana.requests.clear()
    again = push(grafana.url, "--folder", "ML training")
    assert again.exit_code == 0, again.output
    assert [(r["method"], r["path"]) for r in grafana.requests][:2] == [
        ("GET", "/grafana/api/folders"),
        ("POST", "/grafana/api/dashboards/db"),
    ]
    assert {b["version"] for b in grafana.boards.values()} == {2}


def test_push_into_the_general_folder_skips_the_folder_calls(grafana: FakeGrafana) -> None:
    result = push(grafana.url, "--folder", "")
    assert result.exit_code == 0, result.output
    assert {(r["method"], r["path"]) for r in grafana.requests} == {("POST", "/grafana/api/dashboards/db")}
    assert {(r["body"]["folderUid"], r["body"]["folderId"]) for r in grafana.requests} == {("", 0)}


def test_push_with_a_refused_token_exits_1_with_one_line(grafana: FakeGrafana) -> None:
    result = push(grafana.url, token="wrong")
    assert result.exit_code == 1
    (line,) = result.output.strip().splitlines()
    assert "refused the token (401 Unauthorized)" in line
    assert grafana.url in line
    assert not any(r["path"].endswith("/dashboards/db") for r in grafana.requests)


def test_push_errors_exit_1_and_bad_arguments_exit_2(grafana: FakeGrafana, tmp_path: Path) -> None:
    grafana.fail_after = 2
    failed = push(grafana.url)
    assert failed.exit_code == 1
    (line,) = failed.output.strip().splitlines()
    assert "failed while saving dashboard 'opsd-reliability': Server Error 500" in line
    assert line.endswith("(2 of 5 dashboards pushed before)")

    unreachable = push(f"http://127.0.0.1:{free_port()}")
    assert unreachable.exit_code == 1
    assert "cannot reach Grafana" in unreachable.output

    not_found = push(grafana.url.removesuffix("/grafana"))  # no such path: Grafana's 404
    assert not_found.exit_code == 1
    assert "refused listing folders" in not_found.output

    assert push("ftp://grafana").exit_code == 2
    (tmp_path / "broken.json").write_text("{")
    bad_dir = CliRunner().invoke(
        app, ["dashboards", "push", "--grafana-url", grafana.url, "--token", "t", "--dir", str(tmp_path)]
    )
    assert bad_dir.exit_code == 2
    assert "broken.json: not readable as JSON" in bad_dir.output


def test_the_docs_describe_every_dashboard_panel_and_alert() -> None:
    doc = (ROOT / "docs" / "dashboards.md").read_text()
    for name, board in dashboards.build_all().items():
        assert f"`{name}.json`" in doc
        assert f"`{board['uid']}`" in doc
        for p in board["panels"]:
            assert f"| {p['title']} |" in doc, f"docs/dashboards.md does not describe {board['title']} / {p['title']}"
    for alert in ALERTS:
        assert f"| `{alert}` |" in doc
