"""The test launcher: a launch that dies of the known gloo abort runs again (up to GLOO_CRASH_ATTEMPTS launches),
with a warning; others do not."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch import GLOO_CRASH_ATTEMPTS, aborted, run_module


def test_gloo_abort_is_launched_again_with_a_warning(tmp_path: Path) -> None:
    cleaned: list[bool] = []
    with pytest.warns(UserWarning, match=r"crashed \(SIGABRT or SIGSEGV\) inside gloo"):
        proc = run_module("tests.abort_once", [str(tmp_path / "flag")], before_retry=lambda: cleaned.append(True))
    assert proc.returncode == 0
    assert "launch 2" in proc.stdout
    assert cleaned == [True]


def test_the_abort_is_retried_a_bounded_number_of_times(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="inside gloo") as caught:
        ok = run_module("tests.abort_once", [str(tmp_path / "a"), str(GLOO_CRASH_ATTEMPTS - 1)])
    assert ok.returncode == 0
    assert f"launch {GLOO_CRASH_ATTEMPTS}" in ok.stdout
    assert len(caught) == GLOO_CRASH_ATTEMPTS - 1
    with pytest.warns(UserWarning, match="inside gloo"):
        given_up = run_module("tests.abort_once", [str(tmp_path / "b"), str(GLOO_CRASH_ATTEMPTS)])
    assert given_up.returncode == 134  # every attempt aborted: the test that launched it fails
    assert (tmp_path / "b").read_text() == str(GLOO_CRASH_ATTEMPTS)


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
