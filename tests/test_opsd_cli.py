"""The `opsd` console script."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from opsd import __version__
from opsd.backends.local.processes import free_port
from opsd.cli.app import app
from tests.launch import agent_until_sigterm


def test_version() -> None:
    result = CliRunner().invoke(app, ["version"])
    assert result.exit_code == 0
    assert result.output.strip() == __version__


def test_unknown_command_is_a_usage_error() -> None:
    result = CliRunner().invoke(app, ["no-such-command"])
    assert result.exit_code == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--metrics-port", "70000"], "metrics_port must be in 0-65535"),
        (["--socket", "/x" * 60], "at most 107 bytes"),
        (["--metrics-port", "many"], "unable to parse string as an integer"),
    ],
    ids=["port-range", "socket-too-long", "port-not-a-number"],
)
def test_agent_bad_arguments_are_usage_errors(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["agent", *args])
    assert result.exit_code == 2
    assert message in " ".join(result.output.replace("│", " ").split())  # unboxed, unwrapped


def test_agent_runs_until_sigterm(tmp_path: Path) -> None:
    sock = tmp_path / "agent.sock"
    port = free_port()

    def socket_is_bound() -> None:
        assert sock.exists()

    health, ended = agent_until_sigterm(["--socket", str(sock), "--metrics-port", str(port)], port, socket_is_bound)
    assert health["status"] == "ok"
    assert ended.returncode == 0
    assert f"metrics on http://127.0.0.1:{port}/metrics" in ended.stdout
    assert not sock.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run"], "a trainer command is needed (after --)"),
        (["run", "--nodes", "0", "--", "true"], "--nodes and --gpus-per-node must be >= 1"),
        (["serve", "--port", "99999"], "controller.port must be in 0..65535"),
        (["serve", "--tick-interval-s", "0"], "tick_interval_s must be > 0"),
    ],
    ids=["run-no-command", "run-no-nodes", "serve-port", "serve-tick"],
)
def test_controller_commands_refuse_bad_arguments(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert message in result.output


def test_inject_without_a_controller_says_so(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = CliRunner().invoke(app, ["inject", "kill", "--rank", "1", "--url", url, "--state-dir", str(tmp_path)])
    assert result.exit_code == 1
    assert "opsd: " in result.output
    assert "Connection refused" in result.output
