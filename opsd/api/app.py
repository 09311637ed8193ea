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
from typing import Annotated, Any, TypeVar

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ConfigDict, Field

import opsd
from opsd.analysis.flamegraph import fold, to_folded
from opsd.api.answers import SCHEMAS as ANSWER_SCHEMAS
from opsd.api.answers import documented, reply
from opsd.api.auth import Credentials, requirement
from opsd.api.flight import flight_router
from opsd.api.heartbeat import OPENAPI_PATH, HeartbeatEndpoint
from opsd.api.heartbeat import SCHEMAS as HEARTBEAT_SCHEMAS
from opsd.api.heartbeat_ingest import HeartbeatPort, close_heartbeats, open_heartbeats
from opsd.api.liveness import close_liveness, open_liveness
from opsd.api.maintenance import maintenance_router
from opsd.api.writer import HeartbeatWriter
from opsd.controller.controller import Controller
from opsd.controller.metrics import ApiStats, ControllerCollector
from opsd.controller.port import Fault, FaultKind
from opsd.controller.rows import RunRow
from opsd.controller.views import cadence_view, checkpoints_view, flame_stacks, postmortem_bundle, spares_view
from opsd.errors import BodyError, NotFoundError, OpsError, PermanentError, TransientError
from opsd.protocol.answers import CadenceView, Checkpoints, RunStatus, SparePools
from opsd.protocol.bundle import Bundle
from opsd.protocol.heartbeat import PATH
from opsd.protocol.records import Action, IncidentRow, NodeRow
from opsd.protocol.states import ApiRole, NodeRole

log = logging.getLogger(__name__)


class Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class CordonIn(Strict):
    reason: Annotated[str, Field(min_length=1, max_length=1000)]


class RestartIn(Strict):
    reason: Annotated[str, Field(min_length=1, max_length=1000)]


class DrillIn(Strict):
    node: Annotated[str, Field(min_length=1, max_length=253)]
    gpu: Annotated[int, Field(ge=0, le=1023)] = 0
    xid: Annotated[int, Field(ge=1, le=65535)] = 79


class AttachIn(Strict):
    target: Annotated[str, Field(min_length=1, max_length=600)]  # the job in the backend's words: NAMESPACE/JOBSET
    run: Annotated[str, Field(max_length=63)] = ""  # default: the backend's name for it (the JobSet's)


class InjectIn(Strict):
    fault: FaultKind
    node: Annotated[str, Field(max_length=200)] = ""
    gpu: Annotated[int, Field(ge=0)] = 0
    xid: Annotated[int, Field(ge=0)] = 79
    rank: Annotated[int, Field(ge=0)] = 0
    factor: Annotated[float, Field(gt=1, le=100)] = 1.3


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
    app.include_router(maintenance_router(controller, operators, reads, clock))

    @app.get("/v1/runs", dependencies=reads)
    def runs() -> list[RunRow]:
        return controller.store.runs()

    @app.get("/v1/runs/{run}", dependencies=reads, **documented(RunStatus, "The run's status"))
    def run_status(run: str) -> Response:
        status = controller.status(run, clock())
        if status is None:
            raise HTTPException(404, f"no run {run!r}")
        return reply(status)

    @app.get("/v1/runs/{run}/incidents", dependencies=reads)
    def incidents(run: str) -> list[IncidentRow]:
        if controller.store.run(run) is None:
            raise HTTPException(404, f"no run {run!r}")
        return controller.store.incidents(run)

    @app.get("/v1/runs/{run}/actions", dependencies=reads)
    def actions(run: str) -> list[Action]:
        if controller.store.run(run) is None:
            raise HTTPException(404, f"no run {run!r}")
        return controller.store.actions(run=run)

    @app.get("/v1/runs/{run}/flamegraph", response_class=PlainTextResponse, dependencies=reads)
    def flamegraph(run: str, launch: Annotated[int | None, Query(ge=1)] = None) -> PlainTextResponse:
        """The run's time in collectives as folded stacks, summed over its nodes, of every launch or of one
        (``?launch=N``; docs/flamegraph.md). Recorded per launch: a finished run's, and after a restart."""
        per_stack = _answer(lambda: flame_stacks(controller, run, launch))
        stacks = fold((*stack, seconds) for stack, seconds in per_stack.items())
        return PlainTextResponse(to_folded(stacks))

    @app.post("/v1/runs/attach", dependencies=operators)
    def attach(body: AttachIn) -> RunRow:
        """Make a job of the backend's a run (a JobSet without the ``opsd.io/run`` annotation); answers the run."""
        return _answer(lambda: controller.attach_run(body.target, body.run, clock()))

    @app.get("/v1/incidents", dependencies=reads)
    def all_incidents() -> list[IncidentRow]:
        return controller.store.incidents()

    @app.post("/v1/runs/{run}/restart", dependencies=operators)
    def restart(run: str, body: RestartIn) -> IncidentRow:
        """Restart every rank of a running run: a checkpoint first when the ranks progress; answers the incident
        that records it (poll ``/v1/runs/{run}/incidents`` for its end)."""
        return _answer(lambda: controller.request_restart(run, body.reason, clock()))

    @app.post("/v1/runs/{run}/drill", dependencies=operators)
    def drill(run: str, body: DrillIn) -> IncidentRow:
        """Rehearse a fatal XID on one of a running run's nodes: an incident recovered from as a real XID's (the
        node quarantined, a spare taken, the run relaunched), its detail saying it is a drill."""
        return _answer(lambda: controller.drill_xid(run, body.node, body.gpu, body.xid, clock()))

    @app.get("/v1/runs/{run}/checkpoints", dependencies=reads, **documented(Checkpoints, "The run's checkpoints"))
    def checkpoints(run: str) -> Response:
        return reply(_answer(lambda: checkpoints_view(controller, run), refused=400))

    @app.get("/v1/runs/{run}/cadence", dependencies=reads, **documented(CadenceView, "The run's checkpoint cadence"))
    def cadence(run: str) -> Response:
        return reply(_answer(lambda: cadence_view(controller, run, clock()), refused=400))

    @app.get("/v1/runs/{run}/postmortem", dependencies=reads, **documented(Bundle, "The run's post-mortem bundle"))
    def postmortem(run: str) -> Response:
        return reply(_answer(lambda: postmortem_bundle(controller, run, clock()), refused=400))

    @app.get("/v1/spares", dependencies=reads, **documented(SparePools, "The spare pools"))
    def spares() -> Response:
        return reply(spares_view(controller, clock()))

    @app.get("/v1/nodes", dependencies=reads)
    def nodes() -> list[NodeRow]:
        return controller.store.nodes()

    @app.post("/v1/nodes/{node}/cordon", dependencies=operators)
    def cordon(node: str, body: CordonIn) -> NodeRow:
        return _answer(lambda: controller.set_node_role(node, NodeRole.CORDONED, body.reason, clock()))

    @app.post("/v1/nodes/{node}/uncordon", dependencies=operators)
    def uncordon(node: str) -> NodeRow:
        return _answer(lambda: controller.set_node_role(node, NodeRole.SPARE, "", clock()))

    @app.post("/v1/runs/{run}/inject", dependencies=operators)
    def inject(run: str, body: InjectIn) -> dict[str, str]:
        fault = Fault(body.fault, node=body.node, gpu=body.gpu, xid=body.xid, rank=body.rank, factor=body.factor)
        return {"injected": _answer(lambda: controller.inject(run, fault))}

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


T = TypeVar("T")


def _answer(action: Callable[[], T], refused: int = 409) -> T:
    """What an endpoint answers, opsd's errors as HTTP statuses: 404 for what does not exist, 400 for a request that
    asks the impossible, ``refused`` (409: refused in the current state; a read: 400) for the other permanent
    errors, 503 (with ``Retry-After``) for one worth retrying."""
    try:
        return action()
    except NotFoundError as exc:
        raise HTTPException(404, str(exc)) from None
    except BodyError as exc:
        raise HTTPException(400, str(exc)) from None
    except PermanentError as exc:
        raise HTTPException(refused, str(exc)) from None
    except TransientError as exc:
        raise HTTPException(503, str(exc), headers={"Retry-After": str(int(exc.retry_after_s))}) from None
    except OpsError as exc:
        raise HTTPException(503, str(exc)) from None
