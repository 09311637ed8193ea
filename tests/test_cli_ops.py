"""The operator's commands against a real controller (its API served by uvicorn on loopback): where the URL and
the token come from (flag, environment, config file), tables and JSON, exit codes. The commands on a live run
(restart, checkpoints, spares, cadence) are exercised on a real `opsd run` in tests/test_recoveries.py."""

from __future__ import annotations

import http.server
import json
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from opsd.backends.local.processes import free_port
from opsd.cli.app import app
from opsd.cli.connection import config_file
from opsd.controller.controller import Controller
from opsd.controller.state import StateStore
from tests.serving import start_api

TOKEN = "cli-token"


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory) -> Controller:
    return Controller(StateStore.open(f"sqlite:///{tmp_path_factory.mktemp('cli') / 'opsd.db'}"))


@pytest.fixture(scope="module")
def url(controller: Controller) -> Iterator[str]:
    port = free_port()
    server = start_api(controller, TOKEN, "127.0.0.1", port)  # returns once it listens
    base = f"http://127.0.0.1:{port}"
    for node, run in (("n0", "alpha"), ("n1", "beta")):
        body = {
            "v": 1,
            "node": node,
            "time_unix_s": time.time(),
            "ranks": [{"run": run, "rank": 0, "step": 7, "step_s": 0.5, "compute_s": 0.4}],
        }
        request = urllib.request.Request(
            f"{base}/v1/heartbeat",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
        )
        with urllib.request.urlopen(request, timeout=5) as reply:
            assert reply.status == 200
    yield base
    server.should_exit = True


def opsd(*args: str, env: dict[str, str] | None = None) -> Any:
    """The CLI, with the operators' token in $OPSD_TOKEN unless ``env`` says otherwise (every read wants one)."""
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200", "OPSD_TOKEN": TOKEN, **(env or {})})


def test_read_commands_print_json_and_tables(url: str) -> None:
    runs = opsd("runs", "--json", "--url", url)
    assert runs.exit_code == 0, runs.output
    assert sorted(r["id"] for r in json.loads(runs.stdout)) == ["alpha", "beta"]
    every = json.loads(opsd("status", "--json", "--url", url).stdout)
    assert sorted((s["run"], s["step"]) for s in every) == [("alpha", 7), ("beta", 7)]
    table = opsd("status", "--url", url).stdout
    assert "alpha" in table
    assert "beta" in table
    assert "ETTR" in table
    assert json.loads(opsd("incidents", "alpha", "--json", "--url", url).stdout) == []
    assert "run alpha" in opsd("status", "alpha", "--url", url).stdout


def test_the_url_and_token_come_from_the_environment_or_a_config_file(url: str, tmp_path: Path) -> None:
    no_token = {"OPSD_TOKEN": ""}
    denied = opsd("cordon", "n0", "--reason", "bad DIMM", "--url", url, "--state-dir", str(tmp_path), env=no_token)
    assert denied.exit_code == 1
    assert "401" in denied.output
    config = tmp_path / "config.toml"
    config.write_text(f'url = "{url}"\ntoken = "{TOKEN}"\n')
    done = opsd("cordon", "n0", "--reason", "bad DIMM", "--config", str(config), env=no_token)
    assert (done.exit_code, done.stdout.strip()) == (0, "n0: cordoned")
    missing = opsd("uncordon", "n0", env={"OPSD_URL": url, "OPSD_CONFIG": str(tmp_path / "none"), **no_token})
    assert missing.exit_code == 2  # a config file named but missing is a usage error
    assert "does not exist" in missing.output
    assert "401" in opsd("runs", "--url", url, env=no_token).output  # reads want a token too
    back = opsd("uncordon", "n0", env={"OPSD_URL": url, "OPSD_TOKEN": TOKEN})
    assert (back.exit_code, back.stdout.strip()) == (0, "n0: spare")


@pytest.mark.parametrize(
    ("text", "message"),
    [("url = ", "config file"), ('url = "x"\nport = 3\n', "keys are url and token"), ("url = 3\n", "strings")],
    ids=["not-toml", "unknown-key", "not-a-string"],
)
def test_a_bad_config_file_is_a_usage_error(tmp_path: Path, text: str, message: str) -> None:
    config = tmp_path / "config.toml"
    config.write_text(text)
    result = opsd("runs", "--config", str(config))
    assert result.exit_code == 2
    assert message in result.output


def test_refusals_and_unreachable_controllers_exit_1(url: str, tmp_path: Path) -> None:
    refused = opsd("restart", "alpha", "--reason", "x", "--url", url, "--token", TOKEN)
    assert refused.exit_code == 1
    assert "409" in refused.output
    assert "no backend" in refused.output
    missing = opsd("checkpoints", "nope", "--url", url)
    assert (missing.exit_code, "404" in missing.output) == (1, True)
    gone = opsd("spares", "--url", f"http://127.0.0.1:{free_port()}")
    assert gone.exit_code == 1
    assert "opsd: " in gone.output
    bad_url = opsd("runs", "--url", "ftp://x")
    assert bad_url.exit_code == 2


def test_the_cli_doc_names_real_commands_and_a_valid_config_file(tmp_path: Path) -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    (example,) = re.findall(r"^```toml\n(.*?)^```", doc, flags=re.S | re.M)
    config = tmp_path / "config.toml"
    config.write_text(example)
    assert set(config_file(str(config))) == {"url", "token"}
    commands = re.findall(r"^\| `opsd ([a-z]+(?: push)?)", doc, flags=re.M)
    assert len(commands) >= 12
    for command in commands:
        result = opsd(*command.split(), "--help")
        assert result.exit_code == 0, (command, result.output)


NODE = "gpu-node-0117.cluster.example.com"
SPARE = "gpu-node-0342.cluster.example.com"
DETAIL = "no heartbeat for 41.2 s > 30.0 s; " * 4


@pytest.fixture(scope="module")
def incident(url: str, controller: Controller) -> int:
    """A recovered incident of run beta, with its actions (cordon, take a spare, relaunch)."""
    store, now = controller.store, time.time()
    incident_id, _ = store.open_incident(
        key=f"beta:{NODE}:heartbeat_loss:0",
        run="beta",
        kind="heartbeat_loss",
        node=NODE,
        rank=None,
        detail=DETAIL.strip(),
        failed_s=now - 100,
        detected_s=now - 58.8,
    )
    steps = [
        ("cordon", {"node": NODE, "reason": "heartbeat_loss"}, {"node": NODE}),
        ("take_spare", {"for": NODE}, {"spare": SPARE}),
    ]
    for seq, (kind, args, result) in enumerate(steps):
        rid = f"incident-{incident_id}-{seq}-{kind}"
        store.record_action(
            rid, run="beta", incident_id=incident_id, seq=seq, kind=kind, args=args, now_s=now - 50 + seq
        )
        store.complete_action(rid, now - 49 + seq, result)
    store.record_action(
        f"incident-{incident_id}-2-launch",
        run="beta",
        incident_id=incident_id,
        seq=2,
        kind="launch",
        args={"after_generation": 0},
        now_s=now - 40,
    )
    store.update_incident(
        incident_id, state="recovered", resumed_s=now - 30, resumed_from_step=5, lost_steps=2, spare=SPARE
    )
    return incident_id


def widest(text: str) -> int:
    return max(len(line) for line in text.splitlines())


def test_one_incident_in_full_with_its_actions(url: str, incident: int) -> None:
    shown = opsd("incidents", "beta", str(incident), "--url", url, env={"COLUMNS": "80"})
    assert shown.exit_code == 0, shown.output
    out = shown.stdout
    assert widest(out) <= 80
    lines = out.splitlines()
    for name, value in [("node", NODE), ("spare", SPARE), ("state", "recovered"), ("lost steps", "2")]:
        assert any(line.split() == [*name.split(), value] for line in lines), (name, out)
    assert "no heartbeat for 41.2 s" in " ".join(out.split())  # the detail in full, wrapped
    for kind in ("cordon", "take_spare", "launch"):
        assert any(line.split()[1:3] == [kind, "pending" if kind == "launch" else "done"] for line in lines), out
    assert f"→ spare: {SPARE}" in out

    body = json.loads(opsd("incidents", "beta", str(incident), "--json", "--url", url).stdout)
    assert (body["incident"]["id"], body["incident"]["node"], body["incident"]["spare"]) == (incident, NODE, SPARE)
    assert [(a["kind"], a["state"]) for a in body["actions"]] == [
        ("cordon", "done"),
        ("take_spare", "done"),
        ("launch", "pending"),
    ]
    assert body["actions"][1]["result"] == {"spare": SPARE}

    unknown = opsd("incidents", "beta", str(incident + 1000), "--url", url)
    assert unknown.exit_code == 1
    assert f"run beta has no incident {incident + 1000}" in unknown.output
    assert opsd("incidents", "alpha", str(incident), "--url", url).exit_code == 1  # another run's incident


def test_an_80_column_terminal_keeps_key_columns_whole(url: str, incident: int) -> None:
    narrow = opsd("incidents", "--url", url, env={"COLUMNS": "80"}).stdout
    assert widest(narrow) <= 80
    row = next(line for line in narrow.splitlines() if line.startswith(str(incident)))
    assert row.split()[:4] == [str(incident), "beta", "heartbeat_loss", "recovered"]
    assert NODE not in narrow  # a --wide column
    wide = opsd("incidents", "--wide", "--url", url, env={"COLUMNS": "80"}).stdout
    row = next(line for line in wide.splitlines() if line.startswith(str(incident)))
    assert row.split()[:7] == [str(incident), "beta", "heartbeat_loss", NODE, "-", "recovered", "41.2"]
    assert widest(wide) > 80  # wider than the terminal, not cut
    status = opsd("status", "--url", url, env={"COLUMNS": "80"}).stdout
    assert widest(status) <= 80
    assert any(line.split()[:2] == ["beta", "running"] for line in status.splitlines()), status


def test_an_answer_that_does_not_fit_fails_the_command_naming_the_field() -> None:
    """A controller (here a stand-in) whose status has a step that is a word: the CLI decodes the answer as the
    struct the controller builds (opsd.protocol.answers) and says which field is wrong, rather than a traceback."""
    answers = {
        "/v1/runs/x": {"run": "x", "state": "running", "step": "forty"},
        "/v1/runs/x/cadence": {"run": "x", "node_mtbf_h": 5000.0, "failures": "3"},
    }

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(answers[self.path]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        status = opsd("status", "x", "--url", base)
        assert status.exit_code == 1, status.output
        assert "run status (GET /v1/runs/x): Expected `int`, got `str` - at `$.step`" in status.output
        cadence = opsd("cadence", "x", "--url", base)
        assert cadence.exit_code == 1, cadence.output
        assert "Expected `int`, got `str` - at `$.failures`" in cadence.output
    finally:
        server.shutdown()
