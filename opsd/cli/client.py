"""A small client of the controller's API for the CLI: base URL, bearer token, errors turned into opsd's.

``ApiClient`` is what a command holds: ``HttpClient`` (the controller over HTTP), or a reader that falls back on
the state store when no controller answers (``opsd.cli.offline``)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from opsd.errors import ConfigError, OpsError, PermanentError, TransientError


class UnreachableError(TransientError):
    """No controller answers at the URL (refused, timed out, no such host)."""


def answer_error(method: str, path: str, status: int, body: bytes, reason: str = "") -> OpsError:
    """opsd's error for an API answer of ``status`` >= 400 (its JSON ``detail`` in the message)."""
    try:
        detail = json.loads(body).get("detail", "")
    except (ValueError, AttributeError):
        detail = ""
    message = f"{method} {path}: {status} {detail or reason}"
    return TransientError(message) if status >= 500 else PermanentError(message)


class ApiClient(Protocol):
    """What a command asks of the controller's API."""

    @property
    def url(self) -> str: ...

    def get(self, path: str) -> Any: ...

    def get_text(self, path: str) -> str: ...

    def post(self, path: str, body: Mapping[str, object] | None = None) -> Any: ...


class HttpClient:
    def __init__(self, url: str, token: str | None = None, state_dir: str = ".opsd", timeout_s: float = 10.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"controller URL {url!r} must start with http:// or https://")
        self.url = url.rstrip("/")
        self.token = token if token is not None else _token_file(state_dir)
        self.timeout_s = timeout_s

    def get(self, path: str) -> Any:
        return json.loads(self._call("GET", path, None) or b"null")

    def get_text(self, path: str) -> str:
        """A ``text/plain`` answer (the flame graph's folded stacks)."""
        return self._call("GET", path, None).decode()

    def post(self, path: str, body: Mapping[str, object] | None = None) -> Any:
        return json.loads(self._call("POST", path, body) or b"null")

    def _call(self, method: str, path: str, body: Mapping[str, object] | None) -> bytes:
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                answer: bytes = response.read()
                return answer
        except urllib.error.HTTPError as exc:
            raise answer_error(method, path, exc.code, exc.read(), str(exc.reason)) from None
        except (urllib.error.URLError, OSError) as exc:
            raise UnreachableError(f"{self.url}: {exc}") from None


def _token_file(state_dir: str) -> str:
    path = Path(state_dir) / "token"
    try:
        return path.read_text().strip()
    except OSError:
        return ""
