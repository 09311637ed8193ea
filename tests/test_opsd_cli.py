"""The `opsd` console script."""

from __future__ import annotations

from typer.testing import CliRunner

from opsd import __version__
from opsd.cli import app


def test_version() -> None:
    result = CliRunner().invoke(app, ["version"])
    assert result.exit_code == 0
    assert result.output.strip() == __version__


def test_unknown_command_is_a_usage_error() -> None:
    result = CliRunner().invoke(app, ["no-such-command"])
    assert result.exit_code == 2
