"""The API's maintenance windows (``opsd maintenance``): while one holds a run, or every run, the controller detects
and records incidents and carries out no recovery step; at its end the recoveries held start
(``opsd.controller.holds``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Response
from pydantic import BaseModel, ConfigDict, Field

from opsd.api.answers import WINDOWS, documented, reply
from opsd.controller.controller import Controller
from opsd.controller.holds import Hold
from opsd.errors import OpsError, TransientError
from opsd.protocol.answers import MaintenanceWindow, WindowEnded


class HoldIn(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    run: Annotated[str | None, Field(max_length=200)] = None  # None: every run
    reason: Annotated[str, Field(min_length=1, max_length=1000)] = "maintenance"


def _window(hold: Hold) -> MaintenanceWindow:
    return MaintenanceWindow(run=hold.run, reason=hold.reason, since_s=hold.since_s)


def _store(action: Callable[[], Any]) -> Any:
    try:
        return action()
    except TransientError as exc:
        raise HTTPException(503, str(exc), headers={"Retry-After": str(int(exc.retry_after_s))}) from None
    except OpsError as exc:
        raise HTTPException(409, str(exc)) from None


def maintenance_router(
    controller: Controller, operators: Sequence[Any], reads: Sequence[Any], clock: Callable[[], float]
) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/maintenance", dependencies=list(reads), **documented(WINDOWS, "The maintenance windows"))
    def windows() -> Response:
        """The maintenance windows in force."""
        return reply([_window(h) for h in _store(controller.holds.all)])

    @router.post(
        "/v1/maintenance/start", dependencies=list(operators), **documented(MaintenanceWindow, "The window started")
    )
    def start(body: HoldIn) -> Response:
        """Hold the recoveries of a run (``run``), or of every run: incidents are still detected and recorded."""
        return reply(_window(_store(lambda: controller.holds.start(body.run, body.reason, clock()))))

    @router.post("/v1/maintenance/stop", dependencies=list(operators), **documented(WindowEnded, "The window ended"))
    def stop(body: HoldIn) -> Response:
        """End a window; the recoveries it held start at the next detection pass."""
        return reply(WindowEnded(run=body.run, ended=_store(lambda: controller.holds.stop(body.run))))

    return router
