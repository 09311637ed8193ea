"""When the controller's passes run: a detection pass every interval (``tick``, ``opsd.controller.detection``), and
the straggler scoring and cadence planning on a thread of their own, at a lower priority (``score``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from functools import partial

from opsd.controller.detection import Detection
from opsd.controller.needs import ScheduleNeeds
from opsd.controller.scoring import Scoring
from opsd.errors import OpsError
from opsd.protocol.states import RunState

log = logging.getLogger(__name__)

#: the niceness of the scoring's thread: what answers agents (the API's event loop, its liveness and heartbeat
#: processes) and the detection passes get a core first when the machine is short of them
SCORING_NICE = 10


def lower_priority(nice: int) -> None:
    """This thread at niceness ``nice`` (Linux: the thread alone), unless it is already nicer."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), nice))
    except OSError as exc:
        log.debug("the scoring's thread keeps its priority: %s", exc)


class Schedule:
    def __init__(self, core: ScheduleNeeds, detection: Detection, scoring: Scoring) -> None:
        self.core = core
        self.detection = detection
        self.scoring = scoring

    def tick_every(self, interval_s: float, stop: threading.Event) -> None:
        """A detection pass every ``interval_s`` (at the controller's clock) until ``stop`` is set, and the scoring
        and cadence planning on a thread of their own, at ``SCORING_NICE`` (``score_every``). A slot's scoring of
        98,304 ranks takes a second or more, several on a busy machine at that niceness: in the same pass, it put
        off the next detection, and a silent node was found seconds late. Returns once both have stopped (a pass
        left running while the process exits may be inside the state store's driver when the interpreter goes)."""
        scoring = threading.Thread(target=self.score_every, args=(interval_s, stop), name="opsd-scoring", daemon=True)
        scoring.start()
        self._every(interval_s, stop, partial(self.detection.tick, score=False), "detection pass")
        scoring.join()

    def score_every(self, interval_s: float, stop: threading.Event) -> None:
        """``score`` every ``interval_s`` until ``stop`` is set, at ``SCORING_NICE``."""
        lower_priority(SCORING_NICE)
        self._every(interval_s, stop, self.score, "scoring pass")

    def _every(self, interval_s: float, stop: threading.Event, do: Callable[[float], object], what: str) -> None:
        """``do`` at the controller's clock every ``interval_s`` until ``stop`` is set; one that fails is logged and
        the next one runs."""
        while not stop.wait(interval_s):
            try:
                do(self.core.clock())
            except OpsError as exc:
                log.warning("%s skipped: %s", what, exc)
            except Exception:
                log.exception("%s failed", what)

    def score(self, now_s: float) -> None:
        """Score the stragglers and plan the cadence of every running run."""
        for run in self.core.store.runs():
            if run.state == RunState.RUNNING:
                with self.core.scoring_lock:
                    self.scoring._score(run.id, now_s)
                    self.scoring._plan(run, now_s)
