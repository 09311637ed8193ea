"""Waiting in tests: for a condition the test can observe, with a deadline and a message that says what did not
happen.

Every wait of the suite goes through ``wait_for``, so that a test never sleeps in the hope that something has
happened meanwhile, never waits long for what has already died, and fails with what it waited for and what was
going on instead::

    step = wait_for("a committed checkpoint", committed_step, 120, alive=proc, context=lambda: log.read_text()[-3000:])

The deadline is a bound on a hang, not a guess at how fast the machine is: pick it generously.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

T = TypeVar("T")

INTERVAL_S = 0.05


@runtime_checkable
class Process(Protocol):
    """What ``wait_for`` needs of a process it waits on (``subprocess.Popen``, a replica group): its exit status,
    None while it runs."""

    def poll(self) -> int | None: ...


def wait_for(
    what: str,
    check: Callable[[], T | None],
    timeout_s: float,
    *,
    context: Callable[[], str] | None = None,
    alive: Process | Callable[[], bool] | None = None,
    retry_on: tuple[type[Exception], ...] = (),
    interval_s: float = INTERVAL_S,
) -> T:
    """Call ``check`` every ``interval_s`` until it returns something true, and return that.

    Fails (``AssertionError``) with "no WHAT within T s" once ``timeout_s`` has passed, and at once when ``alive``
    says that what the check waits on has died (a process that exited, or a callable that answers False); either
    message ends with ``context()`` (a log's tail, say), read only then. An exception of ``retry_on`` from
    ``check`` means "not yet" (a server not listening yet: ``OSError``); the last one is in the message."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while True:
        try:
            value = check()
        except retry_on as exc:
            last_error, value = exc, None
        if value:
            return value
        gone = _died(alive)
        if gone is not None:
            raise AssertionError(_message(f"no {what}: {gone}", last_error, context))
        if time.monotonic() > deadline:
            raise AssertionError(_message(f"no {what} within {timeout_s:g} s", last_error, context))
        time.sleep(interval_s)


def get_json(url: str, *, token: str = "", timeout_s: float = 2.0) -> Any:
    """GET ``url`` (with the bearer ``token``, if any) and decode its JSON answer; ``OSError`` while nothing
    answers there, or answers with an HTTP error (``urllib.error.HTTPError``)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s) as answer:
        return json.load(answer)


def _died(alive: Process | Callable[[], bool] | None) -> str | None:
    """Why what the wait depends on is gone; None while it lives."""
    if alive is None:
        return None
    if isinstance(alive, Process):
        code = alive.poll()
        return None if code is None else f"the process it waits on exited ({code})"
    return None if alive() else "what it waits on died"


def _message(head: str, error: Exception | None, context: Callable[[], str] | None) -> str:
    parts = [head]
    if error is not None:
        parts.append(f"last: {type(error).__name__}: {error}")
    if context is not None:
        parts.append(context())
    return "\n".join(parts)
