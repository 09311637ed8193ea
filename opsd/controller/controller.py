"""The controller: takes the agents' heartbeats, detects failures and stragglers, keeps incidents, publishes the
checkpoint cadence, and recovers runs through a backend.

It is its core (``opsd.controller.core``: the state store, the configuration, the backend, and what the heartbeats
say, in memory) and parts over it, each an object given the core and the parts it asks, wired in ``__init__`` in the
order they depend on each other:

- ``liveness`` (the datagrams, the telemetry interval) and ``intake`` (the heartbeats);
- ``scoring`` (stragglers and cadence), ``silence`` (agents down), ``maintenance`` (windows that hold recoveries),
  ``progress`` (incidents recovered from, closed), ``detection`` (the detection pass and its incidents) and
  ``schedule`` (the passes on their threads);
- ``operations`` (what an operator asks) and ``reads`` (a run's status and goodput);
- ``recovery``, the executor of recovery plans.

Decisions are the pure functions of ``opsd.policy``; the parts gather their inputs, apply their outputs, and log one
line per decision. Time comes in as ``now_s`` (the controller's wall clock), so tests drive it. The controller
answers for its parts (``heartbeat``, ``tick``, ``status``, ...): the API, the runners and the tests call it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from opsd.controller.config import ControllerConfig
from opsd.controller.core import ControllerCore
from opsd.controller.detection import Detection
from opsd.controller.intake import Intake
from opsd.controller.liveness import Liveness
from opsd.controller.maintenance import Maintenance
from opsd.controller.operations import Operations
from opsd.controller.port import Backend, Fault
from opsd.controller.progress import Progress
from opsd.controller.reads import Reads
from opsd.controller.recovery import Recovery
from opsd.controller.rows import RunRow
from opsd.controller.schedule import Schedule
from opsd.controller.scoring import Scoring
from opsd.controller.silence import Silence
from opsd.controller.state import StateStore
from opsd.controller.tracing import IncidentTracing
from opsd.policy.detection import Failure
from opsd.policy.goodput import Goodput
from opsd.protocol.answers import RunStatus
from opsd.protocol.heartbeat import Heartbeat, HeartbeatReply
from opsd.protocol.policy_file import Policy
from opsd.protocol.records import IncidentRow, NodeRow
from opsd.protocol.states import NodeRole


class Controller(ControllerCore):
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
        self.liveness = Liveness(self)
        self.intake = Intake(self, self.liveness)
        self.scoring = Scoring(self)
        self.silence = Silence(self)
        self.maintenance = Maintenance(self)
        self.progress = Progress(self)
        self.detection = Detection(self, self.scoring, self.silence, self.maintenance, self.progress)
        self.schedule = Schedule(self, self.detection, self.scoring)
        self.operations = Operations(self)
        self.reads = Reads(self)

    # -- the heartbeats and the liveness datagrams (intake, liveness) ----------------------------------------------
    def heartbeat(self, body: Heartbeat, now_s: float, *, wait: bool = True) -> HeartbeatReply:
        return self.intake.heartbeat(body, now_s, wait=wait)

    def take_many(self, bodies: Sequence[tuple[Heartbeat, float]], *, wait: bool = True) -> bool:
        return self.intake.take_many(bodies, wait=wait)

    def register(self, bodies: Sequence[Heartbeat], now_s: float) -> None:
        self.intake.register(bodies, now_s)

    def heartbeat_writes(self, body: Heartbeat) -> bool:
        return self.intake.heartbeat_writes(body)

    def policies(self) -> dict[str, Policy]:
        return self.intake.policies()

    def comm_seconds(self, run: str) -> dict[tuple[str, str, str], float]:
        return self.intake.comm_seconds(run)

    def alive(self, node: str, seq: int, now_s: float) -> str | None:
        return self.liveness.alive(node, seq, now_s)

    def alive_many(self, taken: Sequence[tuple[str, int, float]], *, wait: bool = True) -> int | None:
        return self.liveness.alive_many(taken, wait=wait)

    def contacted(self, node: str, now_s: float) -> None:
        self.liveness.contacted(node, now_s)

    def telemetry_interval_s(self, now_s: float) -> float:
        return self.liveness.telemetry_interval_s(now_s)

    def liveness_channels(self, now_s: float) -> dict[str, int]:
        return self.liveness.liveness_channels(now_s)

    # -- the passes (detection, scoring, schedule) -----------------------------------------------------------------
    def tick(self, now_s: float, *, score: bool = True) -> list[Failure]:
        return self.detection.tick(now_s, score=score)

    def open_failure(self, run: RunRow, failures: list[Failure], now_s: float) -> int:
        return self.detection.open_failure(run, failures, now_s)

    def tick_every(self, interval_s: float, stop: threading.Event) -> None:
        self.schedule.tick_every(interval_s, stop)

    def score(self, now_s: float) -> None:
        self.schedule.score(now_s)

    # -- an operator's requests (operations) -----------------------------------------------------------------------
    def request_restart(self, run_id: str, reason: str, now_s: float) -> IncidentRow:
        return self.operations.request_restart(run_id, reason, now_s)

    def drill_xid(self, run_id: str, node: str, gpu: int, xid: int, now_s: float) -> IncidentRow:
        return self.operations.drill_xid(run_id, node, gpu, xid, now_s)

    def set_node_role(self, node: str, role: NodeRole, reason: str, now_s: float) -> NodeRow:
        return self.operations.set_node_role(node, role, reason, now_s)

    def attach_run(self, target: str, run: str, now_s: float) -> RunRow:
        return self.operations.attach_run(target, run, now_s)

    def inject(self, run: str, fault: Fault) -> str:
        return self.operations.inject(run, fault)

    # -- the reads (reads) -------------------------------------------------------------------------------------------
    def goodput(self, run: RunRow, now_s: float, incidents: list[IncidentRow] | None = None) -> Goodput:
        return self.reads.goodput(run, now_s, incidents)

    def status(self, run_id: str, now_s: float) -> RunStatus | None:
        return self.reads.status(run_id, now_s)
