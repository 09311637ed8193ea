"""What the heartbeat's two ASGI handlers share (the API's, ``opsd.api.heartbeat``, and its process's,
``opsd.api.heartbeat_worker``): the JSON answer, the body read whole, and the refusal of a token."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.types import Receive, Send

from opsd.api.auth import Credentials, Role, check

AGENTS = frozenset({Role.AGENT})


async def respond(send: Send, status: int, payload: Any, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    data = msgspec.json.encode(payload)
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *(headers or [])]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": data})


async def read_body(receive: Receive) -> bytes | None:
    """The request's body; None when the client went away first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def refused(credentials: Credentials, headers: list[tuple[bytes, bytes]], send: Send) -> str | None:
    """The reason a heartbeat's token is refused (``auth``: 401, ``forbidden``: 403), answered; None when it may
    send heartbeats (an agent's or an operator's)."""
    authorization = next((v.decode("latin-1") for k, v in headers if k == b"authorization"), None)
    reason = check(credentials, authorization, AGENTS)
    if reason == "auth":
        await respond(send, 401, {"detail": "a valid bearer token is required"}, [(b"www-authenticate", b"Bearer")])
    elif reason is not None:
        await respond(send, 403, {"detail": "this token's role may not send heartbeats (it takes: agent)"})
    return reason
