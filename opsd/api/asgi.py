"""What the heartbeat's two ASGI handlers share (the API's, ``opsd.api.heartbeat``, and its process's,
``opsd.api.heartbeat_worker``): the JSON answer, and a heartbeat request read, checked and decoded, or refused."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from starlette.types import Receive, Scope, Send

from opsd.api.auth import Credentials, Role, check
from opsd.errors import BodyError
from opsd.protocol.heartbeat import Heartbeat, decode_heartbeat

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


async def heartbeat_request(
    scope: Scope, receive: Receive, send: Send, credentials: Credentials, refuse: Callable[[str], None]
) -> tuple[bytes, Heartbeat] | None:
    """The body of a ``POST`` of a heartbeat and the heartbeat in it; None when it was answered here: 405 for another
    method, 401 or 403 for a token that may not send heartbeats, 422 naming the field for a body that does not fit
    (each refusal counted by ``refuse``, by reason), nothing when the client went away first."""
    if scope["method"] != "POST":
        await respond(send, 405, {"detail": "Method Not Allowed"}, [(b"allow", b"POST")])
        return None
    reason = await refused(credentials, scope["headers"], send)
    if reason is not None:
        refuse(reason)
        return None
    data = await read_body(receive)
    if data is None:
        return None  # the agent gave up: it sends the heartbeat again
    try:
        return data, decode_heartbeat(data)
    except BodyError as exc:
        refuse("validation")
        await respond(send, 422, {"detail": str(exc)[:2000]})
        return None
