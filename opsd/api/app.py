"""The controller's HTTP API (FastAPI; its OpenAPI document is served at ``/openapi.json``).

Agents POST heartbeats; the CLI reads runs, incidents and the action timeline, and cordons nodes. Every endpoint
but ``/healthz`` needs ``Authorization: Bearer <token>`` of a role that may call it (``opsd.api.auth``: operators
everything, readers the reads and ``/metrics``, agents their heartbeats and uploads, Prometheus ``/metrics``); the
OpenAPI document is a read too. Bad bodies get a 4xx with a message naming the field, and are counted
(``opsd_controller_rejected_requests_total``).

Heartbeats, which come at the nodes' rate, are answered by a process of their own on a port of their own
(``opsd.api.heartbeat_ingest``) once the replies name it, else by ``opsd.api.heartbeat`` in front of FastAPI's
routing; the liveness datagrams, a second each, by a process of their own too (``opsd.api.liveness``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

import opsd
from opsd.api.answers import SCHEMAS as ANSWER_SCHEMAS
from opsd.api.auth import Credentials, requirement
from opsd.api.flight import flight_router
from opsd.api.heartbeat import OPENAPI_PATH, HeartbeatEndpoint
from opsd.api.heartbeat import SCHEMAS as HEARTBEAT_SCHEMAS
from opsd.api.heartbeat_ingest import HeartbeatPort, close_heartbeats, open_heartbeats
from opsd.api.liveness import close_liveness, open_liveness
from opsd.api.maintenance import maintenance_router
from opsd.api.operations import operations_router
from opsd.api.runs import runs_router
from opsd.api.writer import HeartbeatWriter
from opsd.controller.controller import Controller
from opsd.controller.metrics import ApiStats, ControllerCollector
from opsd.errors import TransientError
from opsd.protocol.heartbeat import PATH
from opsd.protocol.states import ApiRole

log = logging.getLogger(__name__)


def create_app(
    controller: Controller,
    token: str | Credentials,
    clock: Callable[[], float] = time.time,
    liveness: tuple[str, int] | None = None,
    heartbeats: HeartbeatPort | None = None,
    background: Sequence[Callable[[], Coroutine[Any, Any, None]]] = (),
) -> FastAPI:
    """The API; ``token``: the operators' token alone (every role's work), or every role's ``Credentials``;
    ``liveness``: the UDP address (host, port; 0: any free port) where it takes the agents' liveness datagrams while
    it serves (``opsd.api.liveness``), None: none; ``heartbeats``: where a process of its own answers heartbeats
    (``opsd.api.heartbeat_ingest``), None: the API alone; ``background``: coroutines run in the server's event loop
    while it serves (cancelled when it stops)."""
    credentials = token if isinstance(token, Credentials) else Credentials(operator=token)
    stats = ApiStats()
    writer = HeartbeatWriter(controller, clock)
    heard: set[str] = set()  # nodes whose heartbeat was taken since the heartbeat process was last told of them

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        ingest = await open_liveness(controller, credentials, stats, *liveness) if liveness else None
        apart = await open_heartbeats(controller, credentials, stats, writer, heard, heartbeats) if heartbeats else None
        tasks = [asyncio.create_task(start()) for start in background]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            close_heartbeats(controller, apart)
            close_liveness(controller, ingest)
            writer.close()

    app = FastAPI(
        title="opsd controller",
        version=opsd.__version__,
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
    )
    registry = CollectorRegistry()
    registry.register(ControllerCollector(controller, stats, clock))

    app.add_middleware(
        HeartbeatEndpoint,
        controller=controller,
        credentials=credentials,
        reject=stats.reject,
        clock=clock,
        writer=writer,
        touched=heard,
    )

    def allow(*roles: ApiRole) -> Any:
        """A dependency: operators and ``roles`` through, the others refused (401 or 403, counted)."""
        check = requirement(credentials, stats.reject, *roles)

        def authorized(authorization: Annotated[str | None, Header()] = None) -> None:
            check(authorization)

        return Depends(authorized)

    operators, reads = [allow()], [allow(ApiRole.READER)]

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        stats.reject("validation")
        problems = [f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}" for e in exc.errors()]
        return JSONResponse({"detail": "; ".join(problems)[:2000]}, status_code=422)

    @app.exception_handler(TransientError)
    async def unavailable(request: Request, exc: TransientError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": str(int(exc.retry_after_s))})

    app.include_router(flight_router(controller, allow(ApiRole.AGENT), allow(ApiRole.READER), stats.reject, clock))
    app.include_router(runs_router(controller, reads, clock))
    app.include_router(operations_router(controller, operators, clock))
    app.include_router(maintenance_router(controller, operators, reads, clock))

    @app.get("/metrics", response_class=PlainTextResponse, dependencies=[allow(ApiRole.READER, ApiRole.METRICS)])
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok", "version": opsd.__version__}

    generated = app.openapi

    def openapi() -> dict[str, Any]:
        """FastAPI's document, with the endpoint it does not route (the heartbeat) and its schemas."""
        if app.openapi_schema is None:
            document = generated()
            document["paths"] = {PATH: OPENAPI_PATH, **document.get("paths", {})}
            components = document.setdefault("components", {}).setdefault("schemas", {})
            components.update({**HEARTBEAT_SCHEMAS, **ANSWER_SCHEMAS})
        assert app.openapi_schema is not None
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.get("/openapi.json", include_in_schema=False, dependencies=reads)
    def openapi_document() -> dict[str, Any]:
        return openapi()

    return app
