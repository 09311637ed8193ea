"""The API's maintenance windows (``opsd maintenance``): while one holds a run, or every run, the controller detects
and records incidents and carries out no recovery step; at its end the recoveries held start
(``opsd.controller.holds``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from opsd.controller.controller import Controller
from opsd.controller.holds import Hold
from opsd.errors import OpsError, TransientError


class HoldIn(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    run: Annotated[str | None, Field(max_length=200)] = None  # None: every run
    reason: Annotated[str, Field(min_length=1, max_length=1000)] = "maintenance"


class HoldOut(BaseModel):
    run: str | None  # None: every run
    reason: str
    since_s: float


class StoppedOut(BaseModel):
    run: str | None
    ended: bool  # False: no window held it


def _out(hold: Hold) -> HoldOut:
    return HoldOut(run=hold.run, reason=hold.reason, since_s=hold.since_s)


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

    @router.get("/v1/maintenance", dependencies=list(reads))
    def windows() -> list[HoldOut]:
        """The maintenance windows in force."""
        return [_out(h) for h in _store(controller.holds.all)]

    @router.post("/v1/maintenance/start", dependencies=list(operators))
    def start(body: HoldIn) -> HoldOut:
        """Hold the recoveries of a run (``run``), or of every run: incidents are still detected and recorded."""
        return _out(_store(lambda: controller.holds.start(body.run, body.reason, clock())))

    @router.post("/v1/maintenance/stop", dependencies=list(operators))
    def stop(body: HoldIn) -> StoppedOut:
        """End a window; the recoveries it held start at the next detection pass."""
        return StoppedOut(run=body.run, ended=_store(lambda: controller.holds.stop(body.run)))

    return router
