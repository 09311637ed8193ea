"""The test launcher: a launch that dies of the known gloo abort runs once more, with a warning; others do not."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch import aborted, run_module


def test_gloo_abort_is_launched_again_with_a_warning(tmp_path: Path) -> None:
    cleaned: list[bool] = []
    with pytest.warns(UserWarning, match=r"crashed \(SIGABRT or SIGSEGV\) inside gloo"):
        proc = run_module("tests.abort_once", [str(tmp_path / "flag")], before_retry=lambda: cleaned.append(True))
    assert proc.returncode == 0
    assert "second launch" in proc.stdout
    assert cleaned == [True]


@pytest.mark.parametrize(
    ("stderr", "expected"),
    [
        ("terminate called without an active exception\n", True),
        ("  exitcode  : -6 (pid: 7652)\n  traceback : Signal 6 (SIGABRT) received by PID 7652", True),
        ("  exitcode  : -11 (pid: 28918) of binary: python", True),
        ("  exitcode  : -9 (pid: 7652)", False),
        ("  exitcode  : -60 (pid: 1)", False),
        ("examples.train: error: mesh: unknown dimension", False),
    ],
    ids=["message", "torchrun-exit-6", "torchrun-exit-11", "sigkill", "other-code", "usage-error"],
)
def test_abort_signature(stderr: str, expected: bool) -> None:
    assert aborted(stderr) is expected


def test_no_retry_when_told_not_to(tmp_path: Path) -> None:
    proc = run_module("tests.abort_once", [str(tmp_path / "flag")], retry_gloo_abort=False)
    assert proc.returncode == 134


def test_other_failures_are_not_retried(tmp_path: Path) -> None:
    proc = run_module("examples.train", ["--mesh", "nope=2"])
    assert proc.returncode == 2
    assert "unknown dimension 'nope'" in proc.stderr
