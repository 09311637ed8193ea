"""A rank's way out (``trainer_hooks.process_exit``): the exit code it means, its ``atexit`` handlers run and its
output flushed, and, in a real 2-rank gloo job whose collective is still in flight at the exit, no SIGABRT from a
gloo worker thread (docs/crash.md, "At exit")."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.launch import ROOT
from trainer_hooks.process_exit import exit_code_of

PROGRAM = """
import atexit, sys
from trainer_hooks.process_exit import run_and_exit

atexit.register(lambda: print("atexit ran", flush=False))
print("buffered", end="")  # no newline, no flush: exit_process must flush it

def main():
    {body}

run_and_exit(main)
print("never reached")
"""


def run(body: str) -> subprocess.CompletedProcess[str]:
    script = PROGRAM.format(body=textwrap.indent(body, "    ").strip())
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(ROOT)},
    )


@pytest.mark.parametrize(
    ("body", "code", "stderr"),
    [
        ("return None", 0, ""),
        ("return 3", 3, ""),
        ("sys.exit(4)", 4, ""),
        ("sys.exit('a message')", 1, "a message"),
        ("raise RuntimeError('boom')", 1, "RuntimeError: boom"),
    ],
    ids=["none is 0", "its code", "sys.exit", "sys.exit with a message", "an exception"],
)
def test_the_exit_code_is_mains_and_the_process_ends_as_a_normal_exit_would(body: str, code: int, stderr: str) -> None:
    proc = run(body)
    assert proc.returncode == code, proc.stderr
    assert proc.stdout == "bufferedatexit ran\n"  # the buffered output flushed, the handler run, nothing after
    assert stderr in proc.stderr
    if code == 1 and "boom" in stderr:
        assert "Traceback (most recent call last)" in proc.stderr


@pytest.mark.parametrize(("value", "code"), [(None, 0), (0, 0), (7, 7), (256 + 5, 5), (True, 1)])
def test_exit_code_of_is_sys_exits(value: object, code: int) -> None:
    assert exit_code_of(value) == code


@pytest.mark.slow
def test_a_gloo_rank_that_leaves_a_collective_in_flight_exits_with_its_own_code(tmp_path: Path) -> None:
    """The reproducer's job, ended by ``run_and_exit``: rank 0's exit 3 is what torchrun reports, twice in a row.
    Ended by ``sys.exit(main())`` the same job's rank 0 or 1 died of SIGABRT in 8 of 10 launches here."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gloo_exit_race.py"), "--launches", "2", "--exit", "hooks"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[-1] == "exit_race_wrong_exits_hooks=0 of 2", proc.stdout
    assert [line for line in lines if line.startswith("launch")] == [
        "launch 1 (hooks): rank 0 exit 3",
        "launch 2 (hooks): rank 0 exit 3",
    ]
