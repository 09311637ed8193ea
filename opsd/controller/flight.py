"""The controller's side of the ranks' Flight Recorder dumps: their analyses, and the dumps of a recovery.

- ``analyses``: ``{trigger: analysis}`` (``opsd.analysis.flight_recorder.analyze``) of the dumps kept for a run, what
  ``GET /v1/runs/{run}/flight-recorder`` answers and the post-mortem shows.
- ``collect_dumps`` is the ``dump`` step of a hang's recovery: it puts a ``dump_flight_recorder`` command in the
  policy the agents get with their heartbeats' replies, waits until every rank named has a dump kept (or ``wait_s``
  passes), and takes the command out again.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable

from opsd.analysis.flight_recorder import analyze
from opsd.controller.core import ControllerCore
from opsd.controller.rows import FlightDumpRow
from opsd.errors import BodyError
from opsd.protocol.flight_analysis import Culprit, FlightAnalyses, FlightAnalysis
from opsd.protocol.flight_dump import FlightDump, decode_dump
from opsd.protocol.policy_file import DUMP_COMMAND, Command
from opsd.protocol.states import ActionKind
from opsd.protocol.steps import Dumped

log = logging.getLogger(__name__)

INCIDENT_TRIGGER = re.compile(r"^incident-(\d+)$")
TIMEOUT_PREFIX = "timeout-"


def analyses(controller: ControllerCore, run: str) -> FlightAnalyses:
    """``{trigger: analysis}`` of the dumps kept for ``run`` (what ``GET /v1/runs/{run}/flight-recorder`` answers)."""
    by_trigger: dict[str, list[FlightDumpRow]] = {}
    for row in controller.store.flight_dumps(run):
        by_trigger.setdefault(row.trigger, []).append(row)
    return {trigger: _analysis(controller, trigger, rows) for trigger, rows in sorted(by_trigger.items())}


def kept(rows: list[FlightDumpRow]) -> dict[int, FlightDump]:
    """The dumps kept, by rank, decoded; one that does not decode (kept by an earlier version) is left out, said."""
    dumps = {}
    for row in rows:
        try:
            dumps[row.rank] = decode_dump(row.body)
        except BodyError as exc:
            log.warning("run %s: the dump of rank %d for %s is left out: %s", row.run, row.rank, row.trigger, exc)
    return dumps


def _analysis(controller: ControllerCore, trigger: str, rows: list[FlightDumpRow]) -> FlightAnalysis:
    """The analysis of one trigger's kept dumps. The ranks expected: for a rank's own timeout, that rank; else every
    rank of the world the dumps name, and those the recovery's ``dump`` action asked."""
    dumps = kept(rows)
    incident_id = next((r.incident_id for r in rows if r.incident_id is not None), None)
    if trigger.startswith(TIMEOUT_PREFIX):
        expected = set(dumps)
    else:
        world = max((d.world_size for d in dumps.values()), default=0)
        expected = set(range(world))
        if incident_id is not None:
            for action in controller.store.actions(incident_id=incident_id):
                if action.kind == ActionKind.DUMP and isinstance(done := action.outcome, Dumped):
                    expected |= set(done.ranks_expected)
    return analyze(dumps, sorted(expected), trigger, incident_id)


def culprits(controller: ControllerCore, run: str, trigger: str, ranks_expected: list[int]) -> tuple[Culprit, ...]:
    """The culprits the analysis of ``trigger``'s kept dumps names, first the likeliest;
    ``ranks_expected``: the ranks asked for a dump (with the world the dumps name)."""
    dumps = kept(controller.store.flight_dumps(run, trigger))
    world = max((d.world_size for d in dumps.values()), default=0)
    expected = sorted(set(ranks_expected) | set(range(world)))
    return analyze(dumps, expected, trigger, None).culprits


def collect_dumps(
    controller: ControllerCore,
    run: str,
    trigger: str,
    ranks: list[int],
    wait_s: float,
    *,
    poll_s: float = 0.2,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Dumped:
    """Ask every rank of ``run`` for a Flight Recorder dump named ``trigger`` and wait until ``ranks`` have one kept
    or ``wait_s`` passes; what happened, for the ``dump`` action's result."""
    controller.add_command(run, Command(id=trigger, name=DUMP_COMMAND))
    start = clock()
    try:
        while True:
            dumped = controller.store.flight_ranks(run, trigger)
            if set(ranks) <= dumped or clock() - start >= wait_s:
                break
            sleep(poll_s)
    finally:
        controller.remove_command(run, trigger)
    waited_s = clock() - start
    silent = sorted(set(ranks) - dumped)
    log.info(
        "run %s: flight dumps for %s from %d of %d ranks in %.1f s%s",
        run,
        trigger,
        len(set(ranks) & dumped),
        len(ranks),
        waited_s,
        f"; none from ranks {silent}" if silent else "",
    )
    return Dumped(trigger=trigger, ranks_expected=sorted(ranks), ranks_dumped=sorted(dumped), waited_s=waited_s)
