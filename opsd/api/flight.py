"""The controller's side of Flight Recorder dumps: the HTTP endpoints, and the request for dumps of a recovery.

- ``POST /v1/runs/{run}/flight-recorder`` (an agent's or an operator's token): an agent delivers one rank's dump
  (docs/flight-recorder.md). A body that does not fit ``FlightDump`` (``opsd.protocol.flight_dump``) gets 422
  naming the field (413 above ``MAX_DUMP_BYTES``), counted in
  ``opsd_controller_rejected_requests_total{reason="validation"}``. The first dump of a (run, trigger, rank) is kept;
  a repeat is answered 200 with ``"stored": false``.
- ``GET /v1/runs/{run}/flight-recorder`` (a reader's token, as the next; a dump holds Python stacks):
  ``{trigger: analysis}`` (``opsd.analysis.flight_recorder.analyze``) for each
  trigger.
- ``GET /v1/runs/{run}/flight-recorder/{trigger}/{rank}``: the dump as the rank wrote it.

The analyses and the waiting for a recovery's dumps are the controller's (``opsd.controller.flight``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, HTTPException, Request, Response
from starlette.concurrency import run_in_threadpool

from opsd.api.answers import documented, reply, request_body
from opsd.controller.controller import Controller
from opsd.controller.flight import INCIDENT_TRIGGER, analyses
from opsd.errors import BodyError
from opsd.protocol.flight_analysis import FlightAnalyses
from opsd.protocol.flight_dump import DumpKept, FlightDump, decode_dump

log = logging.getLogger(__name__)

MAX_DUMP_BYTES = 64 << 20

#: a kept dump, answered as the rank's agent sent it: a ``FlightDump`` and the fields of torch's it does not read
RAW_DUMP = {"schema": {"type": "object", "description": "A rank's Flight Recorder dump (docs/flight-recorder.md)"}}


def flight_router(
    controller: Controller,
    upload: Any,
    read: Any,
    reject: Callable[[str], None],
    clock: Callable[[], float] = time.time,
) -> APIRouter:
    """The endpoints above; ``upload`` and ``read`` are the app's token checks of the agents' uploads and of the
    reads (``Depends``), ``reject`` counts a refusal by reason."""
    router = APIRouter(tags=["flight recorder"])
    store = controller.store

    def known(run: str) -> None:
        if store.run(run) is None:
            raise HTTPException(404, f"no run {run!r}")

    def refuse(status: int, detail: str) -> HTTPException:
        reject("validation")
        return HTTPException(status, detail[:2000])

    @router.post(
        "/v1/runs/{run}/flight-recorder",
        dependencies=[upload],
        openapi_extra=request_body(FlightDump),
        **documented(DumpKept, "The dump kept, or a repeat"),
    )
    async def add_dump(run: str, request: Request) -> Response:
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_DUMP_BYTES:
            raise refuse(413, f"a dump is at most {MAX_DUMP_BYTES} bytes")
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > MAX_DUMP_BYTES:
                raise refuse(413, f"a dump is at most {MAX_DUMP_BYTES} bytes")
        try:
            dump = decode_dump(bytes(data))
        except BodyError as exc:
            raise refuse(422, str(exc)) from None
        if dump.run != run:
            raise refuse(422, f"run: the dump is of run {dump.run!r}, posted to {run!r}")
        return reply(await run_in_threadpool(_keep, run, dump, bytes(data).decode()))

    def _keep(run: str, dump: FlightDump, body: str) -> DumpKept:
        known(run)
        incident_id = None
        match = INCIDENT_TRIGGER.match(dump.trigger)
        if match:
            incident = store.incident(int(match.group(1)))
            incident_id = int(incident.id) if incident is not None and incident.run == run else None
        stored = store.add_flight_dump(
            run=run, trigger=dump.trigger, rank=dump.rank, incident_id=incident_id, received_s=clock(), body=body
        )
        log.info(
            "run %s: flight dump of rank %d for %s %s", run, dump.rank, dump.trigger, "kept" if stored else "(a repeat)"
        )
        return DumpKept(run=run, trigger=dump.trigger, rank=dump.rank, stored=stored)

    @router.get(
        "/v1/runs/{run}/flight-recorder",
        dependencies=[read],
        **documented(FlightAnalyses, "The analyses of the run's dumps, by trigger"),
    )
    def run_analyses(run: str) -> Response:
        known(run)
        return reply(analyses(controller, run))

    @router.get(
        "/v1/runs/{run}/flight-recorder/{trigger}/{rank}",
        dependencies=[read],
        response_model=None,
        responses={200: {"description": "The rank's dump as it sent it", "content": {"application/json": RAW_DUMP}}},
    )
    def raw_dump(run: str, trigger: str, rank: int) -> Response:
        row = store.flight_dump(run, trigger, rank)
        if row is None:
            raise HTTPException(404, f"no dump of rank {rank} for {trigger!r} in run {run!r}")
        return Response(row.body, media_type="application/json")

    return router
