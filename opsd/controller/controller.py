"""The controller: takes the agents' heartbeats, detects failures and stragglers, keeps incidents, publishes the
checkpoint cadence, and recovers runs through a backend.

It is made of parts over one core (``opsd.controller.core``: the state store, the configuration, the backend, and
what the heartbeats say, in memory): ``intake`` (heartbeats), ``detection`` and ``scoring`` (the detection pass,
incidents, stragglers, cadence), ``operations`` (what an operator asks), ``reads`` (a run's status and goodput);
``recovery`` is the executor of recovery plans. Decisions are the pure functions of ``opsd.policy``; the controller
gathers their inputs, applies their outputs, and logs one line per decision. Time comes in as ``now_s`` (the
controller's wall clock), so tests drive it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from opsd.controller.config import ControllerConfig
from opsd.controller.detection import Detection
from opsd.controller.intake import Intake
from opsd.controller.operations import Operations
from opsd.controller.port import Backend
from opsd.controller.reads import Reads
from opsd.controller.recovery import Recovery
from opsd.controller.state import StateStore
from opsd.controller.tracing import IncidentTracing


class Controller(Intake, Detection, Operations, Reads):
    def __init__(
        self,
        store: StateStore,
        config: ControllerConfig | None = None,
        backend: Backend | None = None,
        tracing: IncidentTracing | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(store, config, backend, tracing, clock)
        self.recovery: Recovery = Recovery(self)
