"""The controller's HTTP API (FastAPI; its OpenAPI document is served at ``/openapi.json``).

Agents POST heartbeats; the CLI reads runs, incidents and the action timeline, and cordons nodes. Every mutating
endpoint needs ``Authorization: Bearer <token>``; reads, ``/metrics`` and ``/healthz`` do not. Bad bodies get a
4xx with a message naming the field, and are counted (``opsd_controller_rejected_requests_total``).

Heartbeats, which come at the nodes' rate, are taken by ``opsd.ingest`` in front of FastAPI's routing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Header, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field

import opsd
from opsd.controller import Controller
from opsd.errors import PermanentError, TransientError
from opsd.ingest import OPENAPI_PATH, PATH, SCHEMAS, HeartbeatEndpoint, token_ok
from opsd.local import LocalBackend

log = logging.getLogger(__name__)


class Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class CordonIn(Strict):
    reason: Annotated[str, Field(min_length=1, max_length=1000)]


class InjectIn(Strict):
    fault: Literal["xid", "kill", "hang", "slow"]
    node: Annotated[str, Field(max_length=200)] = ""
    gpu: Annotated[int, Field(ge=0)] = 0
    xid: Annotated[int, Field(ge=0)] = 79
    rank: Annotated[int, Field(ge=0)] = 0
    factor: Annotated[float, Field(gt=1, le=100)] = 1.3


class ApiStats:
    def __init__(self) -> None:
        self.rejected: dict[str, int] = {}
        self.requests = 0

    def reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1


def create_app(controller: Controller, token: str, clock: Callable[[], float] = time.time) -> FastAPI:
    if not token:
        raise ValueError("the controller needs a token for its mutating endpoints")
    app = FastAPI(title="opsd controller", version=opsd.__version__)
    stats = ApiStats()
    registry = CollectorRegistry()
    registry.register(ControllerCollector(controller, stats, clock))

    app.add_middleware(HeartbeatEndpoint, controller=controller, token=token, reject=stats.reject, clock=clock)

    def authorized(authorization: Annotated[str | None, Header()] = None) -> None:
        if not token_ok(authorization, token):
            stats.reject("auth")
            raise HTTPException(401, "a valid bearer token is required", headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        stats.reject("validation")
        problems = [f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}" for e in exc.errors()]
        return JSONResponse({"detail": "; ".join(problems)[:2000]}, status_code=422)

    @app.exception_handler(TransientError)
    async def unavailable(request: Request, exc: TransientError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": str(int(exc.retry_after_s))})

    @app.get("/v1/runs")
    def runs() -> list[dict[str, Any]]:
        return controller.store.runs()

    @app.get("/v1/runs/{run}")
    def run_status(run: str) -> dict[str, Any]:
        status = controller.status(run, clock())
        if status is None:
            raise HTTPException(404, f"no run {run!r}")
        return status

    @app.get("/v1/runs/{run}/incidents")
    def incidents(run: str) -> list[dict[str, Any]]:
        if controller.store.run(run) is None:
            raise HTTPException(404, f"no run {run!r}")
        return controller.store.incidents(run)

    @app.get("/v1/runs/{run}/actions")
    def actions(run: str) -> list[dict[str, Any]]:
        if controller.store.run(run) is None:
            raise HTTPException(404, f"no run {run!r}")
        return [a.__dict__ for a in controller.store.actions(run=run)]

    @app.get("/v1/nodes")
    def nodes() -> list[dict[str, Any]]:
        return controller.store.nodes()

    @app.post("/v1/nodes/{node}/cordon", dependencies=[Depends(authorized)])
    def cordon(node: str, body: CordonIn) -> dict[str, Any]:
        return _set_role(controller, node, "cordoned", body.reason, clock())

    @app.post("/v1/nodes/{node}/uncordon", dependencies=[Depends(authorized)])
    def uncordon(node: str) -> dict[str, Any]:
        return _set_role(controller, node, "spare", "", clock())

    @app.post("/v1/runs/{run}/inject", dependencies=[Depends(authorized)])
    def inject(run: str, body: InjectIn) -> dict[str, str]:
        backend = controller.backend
        if controller.store.run(run) is None:
            raise HTTPException(404, f"no run {run!r}")
        if not isinstance(backend, LocalBackend):
            raise HTTPException(409, "fault injection needs the local backend (opsd run)")
        if backend.spec.run != run:
            raise HTTPException(404, f"run {run!r} is not run by this controller")
        try:
            done = backend.inject(
                body.fault, node=body.node, gpu=body.gpu, xid=body.xid, rank=body.rank, factor=body.factor
            )
        except PermanentError as exc:
            raise HTTPException(400, str(exc)) from None
        log.warning("fault injected into run %s: %s", run, done)
        return {"injected": done}

    @app.get("/metrics")
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
            document.setdefault("components", {}).setdefault("schemas", {}).update(SCHEMAS)
        assert app.openapi_schema is not None
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _set_role(controller: Controller, node: str, role: str, reason: str, now_s: float) -> dict[str, Any]:
    if controller.store.node(node) is None:
        raise HTTPException(404, f"no node {node!r}")
    controller.store.upsert_node(node, now_s, role=role, reason=reason)
    log.info("node %s is now %s%s", node, role, f" ({reason})" if reason else "")
    found = controller.store.node(node)
    assert found is not None
    return found


class ControllerCollector(Collector):
    """Run-level metrics, computed at scrape time from the controller's state (docs/metrics.md)."""

    def __init__(self, controller: Controller, stats: ApiStats, clock: Callable[[], float]) -> None:
        self.controller = controller
        self.stats = stats
        self.clock = clock

    def collect(self) -> Iterable[Metric]:
        now = self.clock()
        run_labels = ["run"]
        gauges = {
            "mfu_ratio": GaugeMetricFamily(
                "opsd_run_mfu_ratio", "Job MFU (mean of the ranks' last steps).", labels=run_labels
            ),
            "tokens_per_s": GaugeMetricFamily(
                "opsd_run_tokens_per_second", "Job tokens per second.", labels=run_labels
            ),
            "step": GaugeMetricFamily("opsd_run_step", "The run's newest step.", labels=run_labels),
            "ettr": GaugeMetricFamily(
                "opsd_run_ettr_ratio", "Effective training time ratio so far.", labels=run_labels
            ),
            "spares_available": GaugeMetricFamily(
                "opsd_run_spares_available", "Healthy spare nodes of the run.", labels=run_labels
            ),
        }
        mtbf = GaugeMetricFamily("opsd_run_mtbf_seconds", "The run's MTBF estimate.", labels=run_labels)
        every = GaugeMetricFamily(
            "opsd_run_checkpoint_interval_steps", "Published checkpoint cadence.", labels=run_labels
        )
        stragglers = GaugeMetricFamily("opsd_run_stragglers", "Ranks flagged as stragglers now.", labels=run_labels)
        incidents = CounterMetricFamily("opsd_run_incidents", "Incidents by cause.", labels=["run", "cause"])
        for run in self.controller.store.runs():
            status = self.controller.status(run["id"], now)
            if status is None:
                continue
            for key, family in gauges.items():
                family.add_metric([run["id"]], float(status[key]))
            if status["mtbf_s"] is not None:
                mtbf.add_metric([run["id"]], float(status["mtbf_s"]))
            if status["cadence"] is not None:
                every.add_metric([run["id"]], float(status["cadence"]["every_steps"]))
            stragglers.add_metric([run["id"]], float(len(status["stragglers"])))
            causes: dict[str, int] = {}
            for i in self.controller.store.incidents(run["id"]):
                causes[i["kind"]] = causes.get(i["kind"], 0) + 1
            for cause, n in sorted(causes.items()):
                incidents.add_metric([run["id"], cause], n)
        heartbeats = self.controller.heartbeats_total
        yield from gauges.values()
        yield from (mtbf, every, stragglers, incidents)
        yield CounterMetricFamily("opsd_controller_heartbeats", "Heartbeats taken.", value=heartbeats)
        rejected = CounterMetricFamily(
            "opsd_controller_rejected_requests", "Requests refused, by reason.", labels=["reason"]
        )
        for reason in ("auth", "validation"):
            rejected.add_metric([reason], self.stats.rejected.get(reason, 0))
        yield rejected
