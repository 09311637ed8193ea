"""``POST /v1/heartbeat``: the one endpoint called at the nodes' rate (3,072 a second for 24,576 GPUs).

It is a plain ASGI handler in front of FastAPI's exception handling, routing and dependencies (FastAPI's server
error, telemetry and body size middlewares still run first): on this path those cost about as much as taking the
heartbeat itself. The contract is that of the other endpoints: 401 without a token it knows, 403 with one whose
role is neither ``agent`` nor ``operator`` (``opsd.api.auth``), 422 with a message naming
the field for a body that does not fit ``HeartbeatIn`` (both counted), 503 with ``Retry-After`` when the state
store cannot be reached; ``HeartbeatIn`` is also the request's schema in the OpenAPI document.

The body is parsed and validated in one pass by msgspec. A heartbeat that changes nothing in the store (a known node
of known runs, without GPU events: nearly all of them) is taken on the event loop, in memory; one that may write
goes to the one thread that writes them, in batches (``opsd.api.writer``). The event loop never waits for the
controller's lock: a heartbeat that finds it held is answered at once and taken by the lock's next holder, or by
the loop ``RETRY_S`` later (``opsd.controller.core``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from opsd.api.asgi import heartbeat_request, respond
from opsd.api.auth import Credentials
from opsd.api.liveness import RETRY_S
from opsd.api.writer import HeartbeatWriter
from opsd.controller.controller import Controller
from opsd.errors import TransientError
from opsd.protocol.heartbeat import PATH, json_schemas

log = logging.getLogger(__name__)

_REQUEST_SCHEMA, _REPLY_SCHEMA, SCHEMAS = json_schemas("#/components/schemas/{name}")

#: the endpoint in the OpenAPI document (FastAPI does not route it, so does not describe it)
OPENAPI_PATH = {
    "post": {
        "summary": "Heartbeat",
        "description": "An agent's heartbeat (docs/protocol.md); needs an agent's (or an operator's) bearer token.",
        "operationId": "heartbeat",
        "requestBody": {"required": True, "content": {"application/json": {"schema": _REQUEST_SCHEMA}}},
        "responses": {
            "200": {"description": "Taken", "content": {"application/json": {"schema": _REPLY_SCHEMA}}},
            "401": {"description": "No valid bearer token"},
            "403": {"description": "A token whose role may not send heartbeats"},
            "422": {"description": "The body does not fit the schema; the detail names the field"},
            "503": {"description": "The state store cannot be reached; try again after Retry-After seconds"},
        },
    }
}


class HeartbeatEndpoint:
    """ASGI middleware: takes ``POST /v1/heartbeat`` itself and hands every other request to ``app``."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        controller: Controller,
        credentials: Credentials,
        reject: Callable[[str], None],
        clock: Callable[[], float],
        writer: HeartbeatWriter,
        touched: set[str],
    ) -> None:
        self.app = app
        self.controller = controller
        self.credentials = credentials
        self.reject = reject  # counts a refused request by reason
        self.clock = clock
        self.writer = writer  # the heartbeats that may write: on its thread
        self.touched = touched  # the nodes heard from, whose record the heartbeat process is told (if there is one)
        self.retry: asyncio.TimerHandle | None = None  # what the event loop left for later, taken then if not before

    def _drain(self) -> None:
        self.retry = None
        if not self.controller.drain_now():
            self.retry = asyncio.get_running_loop().call_later(RETRY_S, self._drain)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != PATH:
            await self.app(scope, receive, send)
            return
        taken = await heartbeat_request(scope, receive, send, self.credentials, self.reject)
        if taken is None:
            return
        body = taken[1]
        try:
            if self.controller.heartbeat_writes(body):
                self.controller.contacted(body.node, self.clock())
                reply = await self.writer.take(body)
            else:  # in memory alone: a few tens of microseconds, less than the hop to a thread
                reply = self.controller.heartbeat(body, self.clock(), wait=False)
            if self.controller.deferred and self.retry is None:  # left for the lock's next holder: or for us
                self.retry = asyncio.get_running_loop().call_later(RETRY_S, self._drain)
        except TransientError as exc:
            await respond(send, 503, {"detail": str(exc)}, [(b"retry-after", str(int(exc.retry_after_s)).encode())])
            return
        self.touched.add(body.node)
        await respond(send, 200, reply)
