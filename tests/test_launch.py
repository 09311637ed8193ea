"""The test launcher: a launch that dies of the known gloo abort runs once more, with a warning; others do not."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch import run_module


def test_gloo_abort_is_launched_again_with_a_warning(tmp_path: Path) -> None:
    cleaned: list[bool] = []
    with pytest.warns(UserWarning, match="aborted inside gloo"):
        proc = run_module("tests.abort_once", [str(tmp_path / "flag")], before_retry=lambda: cleaned.append(True))
    assert proc.returncode == 0
    assert "second launch" in proc.stdout
    assert cleaned == [True]


def test_no_retry_when_told_not_to(tmp_path: Path) -> None:
    proc = run_module("tests.abort_once", [str(tmp_path / "flag")], retry_gloo_abort=False)
    assert proc.returncode == 134


def test_other_failures_are_not_retried(tmp_path: Path) -> None:
    proc = run_module("examples.train", ["--mesh", "nope=2"])
    assert proc.returncode == 2
    assert "unknown dimension 'nope'" in proc.stderr
