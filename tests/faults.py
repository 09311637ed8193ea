"""Fault injection into a local run from a test's poll loop, as ``opsd inject`` does through the API."""

from __future__ import annotations

import uuid
from typing import Any

from opsd.backends.local.backend import LocalBackend
from opsd.controller.port import Done, Fault, FaultKind
from opsd.errors import PermanentError


def inject(backend: LocalBackend, kind: FaultKind, **fault: Any) -> str:
    """Inject a fault into the backend's run; what was done, in words. ``PermanentError`` when it names no node or
    running rank (yet)."""
    outcome = backend.inject(backend.spec.run, Fault(kind, **fault), f"test-{uuid.uuid4().hex}")
    if not isinstance(outcome, Done):
        raise PermanentError(outcome.message)
    return outcome.data.injected
