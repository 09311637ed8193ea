"""What every backend of the Backend port (``opsd.controller.port``) needs, written once: a step carried out once
per request id (``Once``), and opsd's errors turned into the port's data (``as_outcome``).

A backend built on them is its adapter (the machine-level calls of each step) and its configuration; the port's
promises (idempotent for a request id, errors as data, a bug the only thing that raises) come from here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

from opsd.controller.port import Done, ErrorKind, Failed, Outcome
from opsd.errors import NotFoundError, OpsError, TransientError

log = logging.getLogger(__name__)

T = TypeVar("T")
Step = Callable[[], Outcome[T]]


class Once:
    """Each request id carried out once while this backend lives: a repeat answers what the first call did and
    changes nothing; a step that did not succeed (``Pending``, ``Failed``) may be carried out again. For a backend
    whose machines outlive it, what it must remember across its own restarts is on the machines (the Kubernetes
    backend's Events); a local one takes up what a dead controller left and starts afresh."""

    def __init__(self) -> None:
        self._done: dict[str, Done[Any]] = {}
        self._lock = threading.RLock()

    def __call__(self, request_id: str, step: Step[T]) -> Outcome[T]:
        with self._lock:
            done = self._done.get(request_id)
            if done is not None:
                return cast("Done[T]", done)  # the same request id is the same step, of the same kind
            outcome = step()
            if isinstance(outcome, Done):
                self._done[request_id] = outcome
            return outcome


def as_outcome(what: str, step: Step[T]) -> Outcome[T]:
    """``step()``'s outcome, opsd's errors as data (the port's contract): ``NotFoundError`` as ``NOT_FOUND``, a
    ``TransientError`` as ``TRANSIENT`` with its retry delay, any other as ``PERMANENT`` (``what`` names the step in
    its message)."""
    try:
        return step()
    except NotFoundError as exc:
        return Failed(ErrorKind.NOT_FOUND, str(exc))
    except TransientError as exc:
        return Failed(ErrorKind.TRANSIENT, str(exc), exc.retry_after_s)
    except OpsError as exc:
        return Failed(ErrorKind.PERMANENT, f"{what}: {exc}")
