"""The one error hierarchy of opsd: adapters turn SDK and I/O exceptions into these.

    OpsError
    ├── TransientError          worth retrying after ``retry_after_s`` (a timeout, a 503, a lost connection)
    └── PermanentError          retrying will not help
        ├── ConfigError         a configuration value, file or command-line argument that cannot be used
        ├── NotFoundError       the run, node, incident or object asked for does not exist
        └── BodyError           a message body that does not fit its schema (the text names the field)

Modules add narrower kinds under these (``WireError``, ``ManifestError``, ``PolicyError``), never beside them.
"""

from __future__ import annotations


class OpsError(Exception):
    """Base of every error opsd raises on purpose."""


class TransientError(OpsError):
    """Worth retrying after ``retry_after_s`` seconds (a timeout, a 503, a lost connection)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        if retry_after_s < 0:
            raise ValueError("retry_after_s must be >= 0")
        super().__init__(message)
        self.retry_after_s = retry_after_s


class PermanentError(OpsError):
    """Retrying will not help (bad input, a missing resource, a refused permission)."""


class ConfigError(PermanentError, ValueError):
    """A configuration value, file or command-line argument that cannot be used."""


class NotFoundError(PermanentError, LookupError):
    """What was asked for (a run, a node, an incident, a Kubernetes object) does not exist."""


class BodyError(PermanentError, ValueError):
    """A message body (an HTTP request, a heartbeat) that does not fit its schema; the text names the field."""
