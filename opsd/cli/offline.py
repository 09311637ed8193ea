"""The operator's read commands without a controller: a finished run's record, read from its state store.

``opsd run`` exits when its run completes, and a controller may be down; what they wrote stays in the state store
(``STATE_DIR/opsd.db``, or a PostgreSQL URL). ``StoreClient`` answers the API's read routes from it: the API's own
application (``opsd.api.app``) over a ``Controller`` that holds the store alone (no backend, no detection pass, no
heartbeats), called in this process as an ASGI application, so that a read answers exactly what the controller
would. It refuses every write: restarting, cordoning or injecting need a running controller.

``Reader`` is what the commands use: the controller when it answers, else, when it cannot be reached and a state
store is there, the store (saying so on standard error).
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import typer

from opsd.cli.client import ApiClient, UnreachableError, answer_error
from opsd.errors import PermanentError

if TYPE_CHECKING:  # the API's libraries are imported only when a store is read
    from starlette.types import ASGIApp, Message, Scope


def store_url(state_dir: str, state_url: str | None) -> str | None:
    """The state store to read: ``state_url``, else ``STATE_DIR/opsd.db`` when it exists, else None."""
    if state_url:
        return state_url
    path = Path(state_dir) / "opsd.db"
    return f"sqlite:///{path}" if path.is_file() else None


class StoreClient:
    """The API's read routes, answered from a state store (``ApiClient``'s interface)."""

    def __init__(self, url: str) -> None:
        from opsd.api.app import create_app  # the API's application and the controller: only when needed
        from opsd.controller.controller import Controller
        from opsd.controller.state import StateStore

        self.url = url
        self.store = StateStore.open(url)
        self.token = secrets.token_hex(16)  # this process's own: the reads are authenticated, as on a controller
        self.app = create_app(Controller(self.store), self.token)

    def get(self, path: str) -> Any:
        return json.loads(self._call("GET", path) or b"null")

    def get_text(self, path: str) -> str:
        return self._call("GET", path).decode()

    def post(self, path: str, body: Mapping[str, object] | None = None) -> Any:
        raise PermanentError(f"POST {path} needs a running controller: only reads are answered from {self.url}")

    def _call(self, method: str, path: str) -> bytes:
        status, body = asyncio.run(_asgi(self.app, method, path, self.token))
        if status >= 400:
            raise answer_error(method, path, status, body)
        return body


async def _asgi(app: ASGIApp, method: str, target: str, token: str) -> tuple[int, bytes]:
    """One request to an ASGI application in this process: its status and body."""
    parts = urlsplit(target)
    scope: Scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": parts.path,
        "raw_path": parts.path.encode(),
        "query_string": parts.query.encode(),
        "root_path": "",
        "headers": [(b"host", b"opsd-state-store"), (b"authorization", f"Bearer {token}".encode())],
        "client": ("127.0.0.1", 0),
        "server": ("opsd-state-store", 80),
    }
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    status = next(int(m["status"]) for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


class Reader:
    """The controller at ``api``; when it cannot be reached, the state store at ``state_url`` (if any)."""

    def __init__(self, api: ApiClient, state_url: str | None, say: Callable[[str], None] | None = None) -> None:
        self.api = api
        self.state_url = state_url
        self.say = say or (lambda text: typer.echo(f"opsd: {text}", err=True))
        self._store: StoreClient | None = None

    @property
    def url(self) -> str:
        return self.api.url

    def get(self, path: str) -> Any:
        return self._either(lambda client: client.get(path))

    def get_text(self, path: str) -> str:
        text: str = self._either(lambda client: client.get_text(path))
        return text

    def post(self, path: str, body: Mapping[str, object] | None = None) -> Any:
        try:
            return self.api.post(path, body)
        except UnreachableError as exc:
            raise PermanentError(f"{exc} (this needs a running controller)") from None

    def _either(self, call: Callable[[Any], Any]) -> Any:
        if self._store is None:
            try:
                return call(self.api)
            except UnreachableError as exc:
                if self.state_url is None:
                    raise
                self._store = StoreClient(self.state_url)
                self.say(f"no controller answers ({exc}): reading the state store {self.state_url}")
        return call(self._store)
