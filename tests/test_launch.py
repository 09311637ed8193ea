"""The test launcher: a launch runs once; only a test that names a known crash gets its launch run again, only when
torchrun's root cause is that crash, each attempt in a fresh directory, and every relaunch counts against the
session's budget."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.torchrun_failure import root_cause
from tests import launch
from tests.launch import RETRY_BUDGET, KnownCrash, Retry, over_budget, run_module, run_module_retrying

SAMPLES = Path(__file__).parent / "torchrun"
CRASH = KnownCrash.GLOO_CONCURRENT_COLLECTIVES


@pytest.fixture
def retries(monkeypatch: pytest.MonkeyPatch) -> list[Retry]:
    """This test's relaunches, kept out of the session's count; relaunching on, even in a soak (which turns it off
    for every other test: these test the relaunch itself)."""
    mine: list[Retry] = []
    monkeypatch.setattr(launch, "RETRIES", mine)
    monkeypatch.delenv(launch.NO_RELAUNCH_ENV, raising=False)
    return mine


@pytest.mark.parametrize(
    ("sample", "expected"),
    [("abort", True), ("segv", True), ("kill", False), ("raise", False), ("record", False)],
)
def test_the_known_crash_is_judged_from_the_root_cause(sample: str, expected: bool) -> None:
    cause = root_cause((SAMPLES / f"{sample}.txt").read_text())
    assert cause is not None
    assert CRASH.matches(cause) is expected


def test_the_budget_is_for_the_whole_session() -> None:
    one = Retry("examples.train --mesh cp=2", CRASH, "rank 1 (SIGABRT): Signal 6 (SIGABRT) received by PID 7")
    assert over_budget([one] * RETRY_BUDGET) is None
    message = over_budget([one] * (RETRY_BUDGET + 1))
    assert message is not None
    assert f"{RETRY_BUDGET + 1} launches were run again" in message
    assert "GLOO_CONCURRENT_COLLECTIVES" in message
    assert "rank 1 (SIGABRT)" in message


@pytest.mark.slow
def test_a_launch_is_not_run_again_without_a_named_cause(tmp_path: Path, retries: list[Retry]) -> None:
    (tmp_path / "run").mkdir()
    proc = run_module("tests.abort_once", [str(tmp_path / "flag"), str(tmp_path / "run")], nproc=2, timeout_s=120)
    assert proc.returncode == 1
    cause = root_cause(proc.stderr)
    assert cause is not None
    assert (cause.rank, cause.signal_name) == (1, "SIGABRT")
    assert (tmp_path / "flag").read_text() == "1"
    assert retries == []


@pytest.mark.slow
def test_the_named_crash_is_launched_again_in_a_fresh_directory(tmp_path: Path, retries: list[Retry]) -> None:
    flag = tmp_path / "flag"
    with pytest.warns(UserWarning, match=r"GLOO_CONCURRENT_COLLECTIVES \(rank 1 \(SIGABRT\)"):
        proc, used = run_module_retrying(
            "tests.abort_once", lambda d: [str(flag), str(d)], crash=CRASH, workdir=tmp_path / "w", nproc=2
        )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert used == tmp_path / "w" / "attempt-2"
    first, second = (sorted(p.name for p in (tmp_path / "w" / f"attempt-{n}").iterdir()) for n in (1, 2))
    assert len(first) == len(second) == 2  # each attempt's ranks wrote only into their own directory
    assert {name.split("-rank")[0] for name in first}.isdisjoint(name.split("-rank")[0] for name in second)
    assert [r.cause for r in retries] == [CRASH]
    assert "attempt-2" not in retries[0].command  # the failed attempt's command
    assert retries[0].root_cause.startswith("rank 1 (SIGABRT)")


@pytest.mark.slow
def test_relaunches_are_bounded_and_other_failures_are_not_relaunched(tmp_path: Path, retries: list[Retry]) -> None:
    with pytest.warns(UserWarning, match="GLOO_CONCURRENT_COLLECTIVES"):
        crashed, _ = run_module_retrying(
            "tests.abort_once",
            lambda d: [str(tmp_path / "a"), str(d), "5"],
            crash=CRASH,
            workdir=tmp_path / "crashes",
            nproc=2,
            attempts=2,
        )
    assert crashed.returncode == 1  # both attempts crashed: the test that launched it fails
    assert (tmp_path / "a").read_text() == "2"
    assert len(retries) == 1

    failed, used = run_module_retrying(
        "tests.abort_once",
        lambda d: [str(tmp_path / "b"), str(d), "1", "raise"],
        crash=CRASH,
        workdir=tmp_path / "errors",
        nproc=2,
    )
    assert failed.returncode == 1
    assert "a Python error, not a crash" in failed.stderr
    assert used.name == "attempt-1"
    assert len(retries) == 1  # the Python error was not run again


def test_other_failures_fail_at_once() -> None:
    proc = run_module("examples.train", ["--mesh", "nope=2"])
    assert proc.returncode == 2
    assert "unknown dimension 'nope'" in proc.stderr
