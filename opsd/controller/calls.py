"""How a recovery calls the backend port: a step asked again while it is under way (``Pending``, for at most
``step_timeout_s``) and after a transient failure (``step_attempts`` in all), each wait at most
``step_retry_max_s``; its data, or ``StepFailedError``."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from opsd.controller.core import ControllerCore
from opsd.controller.port import Backend, Done, ErrorKind, Outcome, Pending
from opsd.errors import OpsError
from opsd.protocol.records import Action

log = logging.getLogger(__name__)
T = TypeVar("T")


class StepFailedError(OpsError):
    """A recovery step the backend could not carry out."""


class BackendCalls:
    """The backend of a controller (``core``), called step by step; ``sleep`` waits between the attempts."""

    core: ControllerCore
    sleep: Callable[[float], None]

    def _backend(self) -> Backend:
        backend = self.core.backend
        if backend is None:
            raise StepFailedError("this controller has no backend to recover with")
        return backend

    def _call(self, step: Callable[[], Outcome[T]], action: Action | None) -> T:
        """Call a backend step until it is done: again after a transient failure (``step_attempts`` in all), again
        while it is under way (``step_timeout_s``); its data, or ``StepFailedError``."""
        config = self.core.config
        what = action.request_id if action is not None else "launch"
        failures = 0
        deadline = time.monotonic() + config.step_timeout_s
        while True:
            outcome = step()
            if isinstance(outcome, Done):
                return outcome.data
            if isinstance(outcome, Pending):
                if time.monotonic() >= deadline:
                    raise StepFailedError(f"{what}: not done within {config.step_timeout_s:.0f} s: {outcome.message}")
                log.info("%s: %s", what, outcome.message)
                self.sleep(min(outcome.retry_after_s, config.step_retry_max_s))
                continue
            failures += 1
            if outcome.kind is not ErrorKind.TRANSIENT or failures >= config.step_attempts:
                raise StepFailedError(f"{what}: {outcome.kind}: {outcome.message}")
            wait_s = min(outcome.retry_after_s, config.step_retry_max_s)
            log.warning("%s: %s (attempt %d); again in %.1f s", what, outcome.message, failures, wait_s)
            self.sleep(wait_s)
