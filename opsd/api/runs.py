"""The API's reads of runs, incidents and nodes: a run's status, incidents, actions, collective flame graph,
checkpoints, cadence and post-mortem bundle, the spare pools and the nodes (readers and operators). Each answer is a
struct of ``opsd.protocol`` that the CLI decodes (``opsd.api.answers``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Response
from fastapi.responses import PlainTextResponse

from opsd.analysis.flamegraph import fold, to_folded
from opsd.api.answers import answer, documented, reply
from opsd.controller.controller import Controller
from opsd.controller.rows import RunRow
from opsd.controller.views import cadence_view, checkpoints_view, flame_stacks, postmortem_bundle, spares_view
from opsd.protocol.answers import CadenceView, Checkpoints, RunStatus, SparePools
from opsd.protocol.bundle import Bundle
from opsd.protocol.records import Action, IncidentRow, NodeRow


def runs_router(controller: Controller, reads: Sequence[Any], clock: Callable[[], float]) -> APIRouter:
    """The reads; ``reads``: the dependencies that let readers and operators through."""
    router = APIRouter()

    @router.get("/v1/runs", dependencies=reads)
    def runs() -> list[RunRow]:
        return controller.store.runs()

    @router.get("/v1/runs/{run}", dependencies=reads, **documented(RunStatus, "The run's status"))
    def run_status(run: str) -> Response:
        status = controller.status(run, clock())
        if status is None:
            raise HTTPException(404, f"no run {run!r}")
        return reply(status)

    @router.get("/v1/runs/{run}/incidents", dependencies=reads)
    def incidents(run: str) -> list[IncidentRow]:
        if controller.store.run(run) is None:
            raise HTTPException(404, f"no run {run!r}")
        return controller.store.incidents(run)

    @router.get("/v1/runs/{run}/actions", dependencies=reads)
    def actions(run: str) -> list[Action]:
        if controller.store.run(run) is None:
            raise HTTPException(404, f"no run {run!r}")
        return controller.store.actions(run=run)

    @router.get("/v1/runs/{run}/flamegraph", response_class=PlainTextResponse, dependencies=reads)
    def flamegraph(run: str, launch: Annotated[int | None, Query(ge=1)] = None) -> PlainTextResponse:
        """The run's time in collectives as folded stacks, summed over its nodes, of every launch or of one
        (``?launch=N``; docs/flamegraph.md). Recorded per launch: a finished run's, and after a restart."""
        per_stack = answer(lambda: flame_stacks(controller, run, launch))
        stacks = fold((*stack, seconds) for stack, seconds in per_stack.items())
        return PlainTextResponse(to_folded(stacks))

    @router.get("/v1/incidents", dependencies=reads)
    def all_incidents() -> list[IncidentRow]:
        return controller.store.incidents()

    @router.get("/v1/runs/{run}/checkpoints", dependencies=reads, **documented(Checkpoints, "The run's checkpoints"))
    def checkpoints(run: str) -> Response:
        return reply(answer(lambda: checkpoints_view(controller, run), refused=400))

    @router.get("/v1/runs/{run}/cadence", dependencies=reads, **documented(CadenceView, "The run's checkpoint cadence"))
    def cadence(run: str) -> Response:
        return reply(answer(lambda: cadence_view(controller, run, clock()), refused=400))

    @router.get("/v1/runs/{run}/postmortem", dependencies=reads, **documented(Bundle, "The run's post-mortem bundle"))
    def postmortem(run: str) -> Response:
        return reply(answer(lambda: postmortem_bundle(controller, run, clock()), refused=400))

    @router.get("/v1/spares", dependencies=reads, **documented(SparePools, "The spare pools"))
    def spares() -> Response:
        return reply(spares_view(controller, clock()))

    @router.get("/v1/nodes", dependencies=reads)
    def nodes() -> list[NodeRow]:
        return controller.store.nodes()

    return router
