"""The API's typed answers (``opsd.protocol.answers``) as HTTP responses: encoded by msgspec as they are, and
documented in ``/openapi.json`` by their JSON schemas (FastAPI documents the pydantic-compatible ones itself; these
are msgspec structs, so a route that answers one names it with ``documented``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
from fastapi import HTTPException, Response

from opsd.errors import BodyError, NotFoundError, OpsError, PermanentError, TransientError
from opsd.protocol.answers import CadenceView, Checkpoints, MaintenanceWindow, RunStatus, SparePools, WindowEnded
from opsd.protocol.bundle import Bundle
from opsd.protocol.flight_analysis import FlightAnalyses
from opsd.protocol.flight_dump import DumpKept, FlightDump

#: the maintenance windows in force
WINDOWS = list[MaintenanceWindow]
#: every answer the API sends as a msgspec struct, documented in ``/openapi.json``
ANSWERS: tuple[object, ...] = (
    RunStatus,
    SparePools,
    Checkpoints,
    CadenceView,
    FlightAnalyses,
    Bundle,
    WINDOWS,
    MaintenanceWindow,
    WindowEnded,
    DumpKept,
)

#: the bodies taken as msgspec structs (the others are pydantic models, which FastAPI documents)
REQUESTS: tuple[object, ...] = (FlightDump,)

REF = "#/components/schemas/{name}"
_REFS, SCHEMAS = msgspec.json.schema_components(ANSWERS + REQUESTS, ref_template=REF)
_BY_TYPE = dict(zip(ANSWERS + REQUESTS, _REFS, strict=True))


def request_body(kind: object) -> dict[str, Any]:
    """A route's ``openapi_extra`` for a body of ``kind`` (one of ``REQUESTS``), decoded by the route itself."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": _BY_TYPE[kind]}}}}


def documented(kind: object, description: str) -> dict[str, Any]:
    """A route's keyword arguments for an answer of ``kind``: its schema in the document, and no response model of
    FastAPI's own."""
    schema = _BY_TYPE[kind]
    return {
        "response_model": None,
        "responses": {200: {"description": description, "content": {"application/json": {"schema": schema}}}},
    }


def reply(answer: object) -> Response:
    """``answer`` as the response's JSON body."""
    return Response(msgspec.json.encode(answer), media_type="application/json")


T = TypeVar("T")


def answer(action: Callable[[], T], refused: int = 409) -> T:
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
