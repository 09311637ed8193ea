"""The contract every backend of the Backend port (``opsd.controller.port``) must pass: the same failure sequences
give the same recorded actions, each done exactly once.

A backend enters the suite through ``Machines``: it sets a run up on its machines (2 nodes of 1 rank and a spare,
or no spare) the way its runner does, and plays the controller's death (``restart``: what a new controller's
backend is, after a crash). The suite drives a real ``Controller`` (state store on SQLite, recovery executor) and
checks, for each scenario:

- the recorded actions: their kinds, order, states, arguments, and the results the table names (a backend may
  record more of its own) are those of the table below, for every backend alike;
- each recorded action is done once: one record per request id, done, with one result;
- each request id changed the machines at most once for each backend instance (``Machines.effects``);
- the end state: the run running at the expected generation, its ranks running on the expected nodes (and no
  other), node roles as expected.

"Controller killed between any two steps": the recovery executor is interrupted (``SimulatedCrash``) at every point
a step passes (recorded, carried out by the backend, recorded done) but after the last step done; a new controller
over the same state store takes the run up and must finish it with the same actions, each done once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from opsd.controller.config import ControllerConfig
from opsd.controller.controller import Controller
from opsd.controller.port import Backend
from opsd.controller.recovery import CARRIED_OUT, COMPLETED, RECORDED
from opsd.controller.state import Action, StateStore
from opsd.policy.detection import Failure, FailureKind
from opsd.protocol.heartbeat import Heartbeat, HeartbeatRank
from opsd.protocol.records import IncidentRow
from opsd.protocol.states import ActionState, IncidentState, NodeRole, RunState
from tests.rows import stored

RUN = "job"
CONFIG = ControllerConfig(flight_wait_s=0.2, restart_checkpoint_wait_s=1.0, step_retry_max_s=0.1)
#: result keys whose values depend on timing or on what a crash left running
VOLATILE = frozenset({"waited_s", "killed"})


class SimulatedCrashError(BaseException):
    """The controller dies here (a BaseException: no ``except Exception`` of the executor catches it)."""


class Machines(Protocol):
    """A backend under the contract suite."""

    name: str

    @property
    def backend(self) -> Backend:
        """The backend the first controller of a scenario uses."""
        ...

    def set_up(self, controller: Controller, nodes: int, spares: int) -> None:
        """Record the run and its nodes (``node-0`` ...; the spares last) in the controller's store, start the
        machines, and make the run's first launch, the way the backend's runner does."""
        ...

    def restart(self, store: StateStore) -> Backend:
        """The controller died: the backend a new controller of the run uses (its machines taken up)."""
        ...

    def effects(self) -> list[tuple[str, str, str]]:
        """Every change made to the machines: (backend instance, request id, step), oldest first."""
        ...

    def placement(self) -> dict[int, str]:
        """The ranks running on the machines now: rank -> node."""
        ...

    def invariants(self) -> None:
        """The backend's own checks at the end of a scenario (none for most)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Scenario:
    name: str
    spares: int
    failure: Failure | None  # None: an operator's graceful restart
    actions: list[tuple[str, dict[str, Any], dict[str, Any]]]  # (kind, args, stable result) in order
    roles: dict[str, NodeRole]
    nodes: list[str]  # the launch's nodes at the end
    uncordon: str = ""  # the node an operator puts back while the run waits for a spare


XID = Failure(FailureKind.FATAL_XID, "node-1", None, "XID 79 on GPU 0: fallen off the bus")
KILL = Failure(FailureKind.PROCESS_EXIT, "node-1", 1, "rank 1 exited with -9")
HANG = Failure(FailureKind.HANG, "node-0", 0, "no step progress for 12.0 s > 10.0 s; furthest behind: rank 0")
ACTIVE, SPARE, CORDONED = NodeRole.ACTIVE, NodeRole.SPARE, NodeRole.CORDONED
LAUNCHED: dict[str, Any] = {"generation": 2}
NO_DUMPS: dict[str, Any] = {"ranks_dumped": []}  # no rank of the suite writes one: the step waits flight_wait_s

SCENARIOS = [
    Scenario(
        "xid_swap",
        1,
        XID,
        [
            ("cordon", {"node": "node-1", "reason": XID.detail}, {"node": "node-1"}),
            ("take_spare", {"for": "node-1"}, {"spare": "node-2"}),
            ("stop", {"generation": 1}, {}),
            ("launch", {"after_generation": 1}, {**LAUNCHED, "nodes": ["node-0", "node-2"]}),
        ],
        {"node-0": ACTIVE, "node-1": CORDONED, "node-2": ACTIVE},
        ["node-0", "node-2"],
    ),
    Scenario(
        "kill",
        1,
        KILL,
        [
            ("stop", {"generation": 1}, {}),
            ("launch", {"after_generation": 1}, {**LAUNCHED, "nodes": ["node-0", "node-1"]}),
        ],
        {"node-0": ACTIVE, "node-1": ACTIVE, "node-2": SPARE},
        ["node-0", "node-1"],
    ),
    Scenario(
        "hang_with_dump",
        1,
        HANG,
        [
            ("dump", {"trigger": "incident-1"}, {"trigger": "incident-1", "ranks_expected": [0, 1], **NO_DUMPS}),
            ("stop", {"generation": 1}, {}),
            ("launch", {"after_generation": 1}, {**LAUNCHED, "nodes": ["node-0", "node-1"]}),
        ],
        {"node-0": ACTIVE, "node-1": ACTIVE, "node-2": SPARE},
        ["node-0", "node-1"],
    ),
    Scenario(
        "graceful_restart",
        1,
        None,
        [
            ("checkpoint", {"at_step": None}, {"checkpoint_step": None, "why": "no checkpoint store"}),
            ("stop", {"generation": 1}, {}),
            ("launch", {"after_generation": 1}, {**LAUNCHED, "nodes": ["node-0", "node-1"]}),
        ],
        {"node-0": ACTIVE, "node-1": ACTIVE, "node-2": SPARE},
        ["node-0", "node-1"],
    ),
    Scenario(
        "no_spare_then_uncordoned",
        0,
        XID,
        [
            ("cordon", {"node": "node-1", "reason": XID.detail}, {"node": "node-1"}),
            ("take_spare", {"for": "node-1"}, {"spare": "node-1"}),
            ("stop", {"generation": 1}, {}),
            ("launch", {"after_generation": 1}, {**LAUNCHED, "nodes": ["node-0", "node-1"]}),
        ],
        {"node-0": ACTIVE, "node-1": ACTIVE},
        ["node-0", "node-1"],
        uncordon="node-1",
    ),
]
BY_NAME = {s.name: s for s in SCENARIOS}


def crash_points(scenario: Scenario) -> list[tuple[str, int]]:
    """Every point a step passes, but the last step's done (after it, the recovery is over)."""
    last = len(scenario.actions) - 1
    return [
        (point, seq)
        for seq in range(len(scenario.actions))
        for point in (RECORDED, CARRIED_OUT, COMPLETED)
        if (point, seq) != (COMPLETED, last)
    ]


def controller_of(store: StateStore, backend: Backend) -> Controller:
    controller = Controller(store, CONFIG, backend)
    controller.recovery.threaded = False  # each recovery carried out before the call that starts it returns
    return controller


def play(machines: Machines, store: StateStore, scenario: Scenario, crash: tuple[str, int] | None = None) -> None:
    """Run ``scenario`` on fresh machines; with ``crash``, the controller dies at that point and a new one takes the
    run up. Raises AssertionError when the contract is broken."""
    controller = controller_of(store, machines.backend)
    machines.set_up(controller, nodes=2, spares=scenario.spares)
    report_ranks(controller)
    if crash is not None:
        controller.recovery.on_step = crash_at(*crash)
    crashed = False
    try:
        start(controller, scenario)
        if scenario.uncordon:
            stopped_while_waiting(machines, scenario)
            uncordon(controller, scenario.uncordon)
    except SimulatedCrashError:
        crashed = True
    if crash is not None:
        assert crashed, f"the recovery never reached {crash}"
        successor = controller_of(store, machines.restart(store))
        run = store.run(RUN)
        assert run is not None
        successor.recovery.take_up(run, time.time(), "the controller died (contract suite)")
        if scenario.uncordon and stored(store.run(RUN)).state == RunState.WAITING_FOR_SPARE:
            stopped_while_waiting(machines, scenario)
            uncordon(successor, scenario.uncordon)
    check(machines, store, scenario, incident_of(store))
    machines.invariants()


def report_ranks(controller: Controller) -> None:
    """A heartbeat from each active node with its rank (rank i on the i-th node), as its agent sends: the controller
    knows the run's ranks (a dump asks them)."""
    now = time.time()
    active = sorted(controller.store.node_names(RUN, NodeRole.ACTIVE))
    for rank, node in enumerate(active):
        ranks = [HeartbeatRank(run=RUN, rank=rank, step=1, step_s=0.1, last_report_unix_s=now)]
        controller.heartbeat(Heartbeat(v=1, node=node, time_unix_s=now, ranks=ranks), now)


def start(controller: Controller, scenario: Scenario) -> int:
    """The scenario's incident, opened as the detection pass or an operator does (the recovery runs meanwhile)."""
    run = controller.store.run(RUN)
    assert run is not None
    if scenario.failure is None:
        return controller.request_restart(RUN, "contract", time.time()).id
    return controller.open_failure(run, [scenario.failure], time.time())


def stopped_while_waiting(machines: Machines, scenario: Scenario) -> None:
    """A run waiting for a spare has had its ranks stopped: no rank runs on the failed node (on a cluster, the
    JobSet may start the pods of its next attempt meanwhile, never there)."""
    assert scenario.failure is not None
    placed = machines.placement()
    assert scenario.failure.node not in placed.values(), f"ranks run on while the run waits: {placed}"


def uncordon(controller: Controller, node: str) -> None:
    """The run waits for a spare; an operator puts ``node`` back and the detection pass goes on with the recovery."""
    run = controller.store.run(RUN)
    assert run is not None
    assert run.state == RunState.WAITING_FOR_SPARE, run
    controller.set_node_role(node, NodeRole.SPARE, "", time.time())
    controller.tick(time.time())


def crash_at(point: str, seq: int) -> Callable[[str, Action], None]:
    def on_step(at: str, action: Action) -> None:
        if (at, action.seq) == (point, seq) and action.run == RUN:
            raise SimulatedCrashError(f"{point} of step {seq}")

    return on_step


def incident_of(store: StateStore) -> IncidentRow:
    (incident,) = store.incidents(RUN)
    return incident


def check(machines: Machines, store: StateStore, scenario: Scenario, incident: IncidentRow) -> None:
    actions = store.actions(incident_id=incident.id)
    seen = [(a.kind, a.args, stable(a.result, r)) for a, (_, _, r) in zip(actions, scenario.actions, strict=False)]
    assert seen == [(k, a, r) for k, a, r in scenario.actions], (scenario.name, [(a.kind, a.result) for a in actions])
    assert all(a.state == ActionState.DONE for a in actions), actions
    assert len({a.request_id for a in actions}) == len(actions)
    counts: dict[tuple[str, str], int] = {}
    for instance, request_id, _step in machines.effects():
        counts[(instance, request_id)] = counts.get((instance, request_id), 0) + 1
    twice = {k: n for k, n in counts.items() if n > 1}
    assert not twice, f"{scenario.name}: steps that changed the machines more than once: {twice}"
    run = store.run(RUN)
    assert run is not None
    assert (run.state, run.generation) == (RunState.RUNNING, 2), run
    roles = {n.name: n.role for n in store.nodes() if n.run in (RUN, None)}  # None: a shared spare pool
    assert roles == scenario.roles, roles
    assert incident.state == IncidentState.OPEN  # recovered once the new launch steps (the detection pass)
    launch = actions[-1].result or {}
    assert launch["nodes"] == scenario.nodes
    assert machines.placement() == dict(enumerate(scenario.nodes)), machines.placement()  # one rank per node


def stable(result: dict[str, Any] | None, expected: dict[str, Any]) -> dict[str, Any]:
    """The result's values of the keys the table names (a backend may add its own; timing values left out)."""
    return {k: v for k, v in (result or {}).items() if k in expected and k not in VOLATILE}


def scenarios_with_crashes(names: list[str]) -> Iterator[tuple[str, tuple[str, int]]]:
    for name in names:
        for point in crash_points(BY_NAME[name]):
            yield name, point
