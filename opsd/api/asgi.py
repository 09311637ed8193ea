"""What the heartbeat's two handlers share (the API's ASGI handler, ``opsd.api.heartbeat``, and its process's HTTP
server, ``opsd.api.heartbeat_worker``): a heartbeat request judged (``judge``: refused, or the heartbeat in it), and
the JSON answer on ASGI."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec
from starlette.types import Receive, Scope, Send

from opsd.api.auth import Credentials, check
from opsd.errors import BodyError
from opsd.protocol.heartbeat import Heartbeat, decode_heartbeat
from opsd.protocol.states import ApiRole

AGENTS = frozenset({ApiRole.AGENT})


class Refusal(NamedTuple):
    """A heartbeat request answered without taking it."""

    status: int
    detail: str
    headers: list[tuple[bytes, bytes]]
    reason: str | None  # what it is counted as (``auth``, ``forbidden``, ``validation``); None: not counted


def refusal_of(credentials: Credentials, method: str, authorization: str | None) -> Refusal | None:
    """Whether a request may bring a heartbeat at all: 405 for another method than ``POST``, 401 or 403 for a token
    that may not send heartbeats (an agent's or an operator's may); None when it may."""
    if method != "POST":
        return Refusal(405, "Method Not Allowed", [(b"allow", b"POST")], None)
    reason = check(credentials, authorization, AGENTS)
    if reason == "auth":
        return Refusal(401, "a valid bearer token is required", [(b"www-authenticate", b"Bearer")], reason)
    if reason is not None:
        return Refusal(403, "this token's role may not send heartbeats (it takes: agent)", [], reason)
    return None


def decoded(data: bytes) -> Refusal | Heartbeat:
    """The heartbeat in a body, or 422 naming the field that does not fit."""
    try:
        return decode_heartbeat(data)
    except BodyError as exc:
        return Refusal(422, str(exc)[:2000], [], "validation")


def judge(credentials: Credentials, method: str, authorization: str | None, data: bytes) -> Refusal | Heartbeat:
    """A heartbeat request's refusal (``refusal_of``, ``decoded``), or the heartbeat in it."""
    return refusal_of(credentials, method, authorization) or decoded(data)


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


def _authorization(headers: list[tuple[bytes, bytes]]) -> str | None:
    return next((v.decode("latin-1") for k, v in headers if k == b"authorization"), None)


async def heartbeat_request(
    scope: Scope, receive: Receive, send: Send, credentials: Credentials, refuse: Callable[[str], None]
) -> tuple[bytes, Heartbeat] | None:
    """The body of a ``POST`` of a heartbeat and the heartbeat in it; None when it was answered here (``judge``; each
    refusal counted by ``refuse``, by reason; the token is judged before the body is read), nothing when the client
    went away first."""
    refused = refusal_of(credentials, scope["method"], _authorization(scope["headers"]))
    data = b""
    if refused is None:
        read = await read_body(receive)
        if read is None:
            return None  # the agent gave up: it sends the heartbeat again
        data = read
    judged = refused or decoded(data)
    if isinstance(judged, Heartbeat):
        return data, judged
    if judged.reason is not None:
        refuse(judged.reason)
    await respond(send, judged.status, {"detail": judged.detail}, judged.headers)
    return None
