"""The API's typed answers (``opsd.protocol.answers``) as HTTP responses: encoded by msgspec as they are, and
documented in ``/openapi.json`` by their JSON schemas (FastAPI documents the pydantic-compatible ones itself; these
are msgspec structs, so a route that answers one names it with ``documented``)."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import Response

from opsd.protocol.answers import CadenceView, Checkpoints, RunStatus, SparePools
from opsd.protocol.bundle import Bundle
from opsd.protocol.flight_analysis import FlightAnalyses

#: every answer a read of the API sends as a msgspec struct, documented in ``/openapi.json``
ANSWERS: tuple[object, ...] = (RunStatus, SparePools, Checkpoints, CadenceView, FlightAnalyses, Bundle)

REF = "#/components/schemas/{name}"
_REFS, SCHEMAS = msgspec.json.schema_components(ANSWERS, ref_template=REF)
_BY_TYPE = dict(zip(ANSWERS, _REFS, strict=True))


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
