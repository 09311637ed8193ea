"""How a launch ended is read from torchrun's root-cause block (real torchrun output in tests/torchrun/: a rank
killed by SIGABRT, SIGSEGV or SIGKILL, a rank raising without and with ``@record``), and the crash-rate table
counts it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from bench.crash_rates import Row, crash_ratio, parse_layout, render, trainer_args
from bench.torchrun_failure import outcome as launch_outcome
from bench.torchrun_failure import root_cause

SAMPLES = Path(__file__).parent / "torchrun"


def sample(name: str) -> str:
    return (SAMPLES / f"{name}.txt").read_text()


@pytest.mark.parametrize(
    ("name", "exitcode", "signal", "result"),
    [
        ("abort", -6, "SIGABRT", "SIGABRT"),
        ("segv", -11, "SIGSEGV", "SIGSEGV"),
        ("kill", -9, "SIGKILL", "SIGKILL"),
        ("raise", 1, None, "exit 1"),
        ("record", 1, None, "exit 1"),
    ],
)
def test_the_root_cause_is_the_first_failure_not_the_ranks_stopped_after_it(
    name: str, exitcode: int, signal: str | None, result: str
) -> None:
    cause = root_cause(sample(name))
    assert cause is not None
    if name != "record":  # rank 0 is listed too, stopped by torchrun's SIGTERM: not the root cause
        assert "exitcode  : -15" in sample(name)
    assert (cause.rank, cause.local_rank, cause.exitcode, cause.signal_name) == (1, 1, exitcode, signal)
    assert launch_outcome(1, sample(name)) == result


def test_a_rank_that_prints_a_signal_exit_code_did_not_crash() -> None:
    text = sample("raise")
    assert "exitcode  : -6" in text  # in the rank's own error message: what matching all of stderr once took
    cause = root_cause(text)
    assert cause is not None
    assert cause.signal_name is None
    assert (
        cause.describe()
        == "rank 1 (exit 1): To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
    )


def test_a_recorded_traceback_is_kept_whole() -> None:
    cause = root_cause(sample("record"))
    assert cause is not None
    lines = cause.traceback.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert "ValueError: a Python error in rank 1" in lines
    assert lines[-2:] == ["ValueError: a Python error in rank 1", "with a second line"]


def test_a_signal_has_its_line() -> None:
    cause = root_cause(sample("abort"))
    assert cause is not None
    assert cause.traceback == f"Signal 6 (SIGABRT) received by PID {cause.pid}"
    assert cause.describe() == f"rank 1 (SIGABRT): Signal 6 (SIGABRT) received by PID {cause.pid}"


@pytest.mark.parametrize(
    ("returncode", "stderr", "result"),
    [
        (0, "", "ok"),
        (-6, "", "SIGABRT"),  # one rank, no torchrun: the process itself
        (2, "examples.train: error: mesh: unknown dimension 'nope'", "exit 2"),
        (1, "Root Cause (first observed failure):\n[0]:\n  rank      : garbled\n", "exit 1"),
    ],
    ids=["ok", "single-process-signal", "no-root-cause", "garbled-block"],
)
def test_outcome_without_a_root_cause_block(returncode: int, stderr: str, result: str) -> None:
    assert launch_outcome(returncode, stderr) == result


def test_the_table_counts_each_outcome_and_the_crash_rate() -> None:
    rows = [
        Row("cp+fsdp", "plain", Counter({"ok": 7, "SIGABRT": 2, "SIGSEGV": 1})),
        Row("fsdp", "monitor", Counter({"ok": 9, "hang": 1})),
    ]
    lines = render(rows).splitlines()
    assert lines[0].split() == ["layout", "variant", "launches", "ok", "SIGABRT", "SIGSEGV", "hang", "crash", "rate"]
    assert lines[1].split() == ["cp+fsdp", "plain", "10", "7", "2", "1", "0", "30.0%"]
    assert lines[2].split() == ["fsdp", "monitor", "10", "9", "0", "0", "1", "0.0%"]  # a hang is not a crash
    assert crash_ratio(rows) == pytest.approx(3 / 20)
    assert crash_ratio([]) == 0.0


def test_layouts_by_name_or_spelled_out(tmp_path: Path) -> None:
    assert parse_layout("cp+fsdp") == ("cp+fsdp", 4, "cp=2,dp_shard=2")
    assert parse_layout("cp4=4:cp=4") == ("cp4", 4, "cp=4")
    with pytest.raises(ValueError, match="expected one of"):
        parse_layout("nope")
    with pytest.raises(ValueError, match="positive integer"):
        parse_layout("x=0:dp_shard=2")
    args = trainer_args("dp_shard=2", 3, "monitor+ckpt", tmp_path)
    assert args[args.index("--ckpt-dir") + 1] == f"file://{tmp_path / 'ckpt'}"
    assert "--opsd-monitor" in args
    assert "--ckpt-dir" not in trainer_args("dp_shard=2", 3, "monitor", tmp_path)
