"""How every test waits (tests/waiting.py): ``wait_for`` returns what the check found, fails at its deadline with what
it waited for and the context, fails at once when what it waits on has died, and takes named exceptions as "not
yet"."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from tests.waiting import wait_for


def counting(answers: list[object]) -> Callable[[], object]:
    """A check that gives ``answers`` one per call (an exception is raised), then the last one again."""
    calls = iter(answers)
    last: list[object] = [None]

    def check() -> object:
        answer = next(calls, last[0])
        last[0] = answer
        if isinstance(answer, Exception):
            raise answer
        return answer

    return check


def test_the_checks_first_true_value_is_returned() -> None:
    assert wait_for("a value", counting([None, 0, "", {"step": 3}]), 10, interval_s=0) == {"step": 3}


def test_past_the_deadline_it_says_what_did_not_come_and_the_context() -> None:
    started = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        wait_for("committed checkpoint", lambda: False, 0.1, context=lambda: "the log's tail", interval_s=0.01)
    assert time.monotonic() - started >= 0.1
    assert str(failed.value) == "no committed checkpoint within 0.1 s\nthe log's tail"


def test_a_process_that_exited_fails_the_wait_at_once() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"^no token: the process it waits on exited \(3\)$"):
        wait_for("token", lambda: False, 60, alive=proc)
    assert time.monotonic() - started < 30


def test_a_callable_that_says_dead_fails_the_wait_at_once() -> None:
    with pytest.raises(AssertionError, match=r"^no quorum: what it waits on died\ngroups: \{1: -9\}$"):
        wait_for("quorum", lambda: False, 60, alive=lambda: False, context=lambda: "groups: {1: -9}")


def test_named_exceptions_are_not_yet_and_the_last_one_is_reported() -> None:
    refused = ConnectionRefusedError(111, "Connection refused")
    assert wait_for("an answer", counting([refused, refused, "ok"]), 10, retry_on=(OSError,), interval_s=0) == "ok"
    with pytest.raises(AssertionError, match=r"within 0.05 s\nlast: ConnectionRefusedError: .*Connection refused"):
        wait_for("an answer", counting([refused]), 0.05, retry_on=(OSError,), interval_s=0.01)
    with pytest.raises(ValueError, match="not a port"):  # any other exception is the test's failure, at once
        wait_for("an answer", counting([ValueError("not a port")]), 10, retry_on=(OSError,))
