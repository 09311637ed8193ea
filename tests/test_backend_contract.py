"""The Backend port's contract (tests/backend_contract.py) against each backend: ``FakeBackend`` (in memory, fast),
``LocalBackend`` (real agents and rank processes on this machine: slow), a plug-in's (``tests.plugin_backend``: its
machines a JSON ledger) and ``KubernetesBackend`` (on the emulated
API server with JobSet's controller and the scheduler played, ``tests.kube.machines``: a controller's successor is
a new backend, informers and reconciler over the same cluster and state store)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from opsd.backends.fake import FakeBackend
from opsd.backends.local.backend import LocalBackend, effects
from opsd.backends.local.spec import LocalRunSpec
from opsd.backends.local.supervise import start_run
from opsd.controller.controller import Controller
from opsd.controller.port import Backend
from opsd.controller.rows import RunSpec
from opsd.controller.state import StateStore
from opsd.protocol.states import NodeRole
from tests.backend_contract import (
    BY_NAME,
    RUN,
    SCENARIOS,
    Machines,
    Scenario,
    crash_points,
    play,
    scenarios_with_crashes,
)
from tests.kube.emulator import KubeEmulator
from tests.kube.machines import KubeMachines
from tests.plugin_backend.backend import LedgerBackend, LedgerPart, new_ledger, read_ledger
from tests.plugin_backend.config import LedgerConfig
from tests.plugin_backend.entry import take_up

SLEEPING_RANK = (sys.executable, "-c", "import time; time.sleep(3600)")  # a rank that neither steps nor ends


class FakeMachines:
    """The in-memory backend; its machines outlive a controller (a new one is handed the same backend)."""

    name = "fake"

    def __init__(self) -> None:
        self.backend = FakeBackend(gpus_per_node=1)

    def set_up(self, controller: Controller, nodes: int, spares: int) -> None:
        store, now = controller.store, time.time()
        names = [f"node-{i}" for i in range(nodes + spares)]
        self.backend.nodes = dict.fromkeys(names, "ready")
        store.create_run(RUN, RunSpec(backend="fake"), now)
        for i, node in enumerate(names):
            role = NodeRole.ACTIVE if i < nodes else NodeRole.SPARE
            store.upsert_node(node, now, run=RUN, role=role, domain=f"rack{i % 2}")
        controller.recovery.launch_first(RUN, now)

    def restart(self, store: StateStore) -> Backend:
        return self.backend

    def effects(self) -> list[tuple[str, str, str]]:
        return [("fake", c.request_id, c.step) for c in self.backend.effects]

    def placement(self) -> dict[int, str]:
        return dict(self.backend.runs[RUN].ranks)

    def invariants(self) -> None:
        pass

    def close(self) -> None:
        pass


class LocalMachines:
    """The local backend: an agent per node and sleeping rank processes; a controller's death leaves them running,
    and its successor's backend kills them and starts the agents again (``take_up_machines``)."""

    name = "local"

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.spec = self._spec(nodes=2, spares=1)
        self.backend = LocalBackend(self.spec)
        self.backends = [self.backend]

    def _spec(self, nodes: int, spares: int) -> LocalRunSpec:
        workdir = str(self.tmp_path / "runs")
        return LocalRunSpec(RUN, SLEEPING_RANK, nodes=nodes, gpus_per_node=1, spares=spares, workdir=workdir)

    def set_up(self, controller: Controller, nodes: int, spares: int) -> None:
        if (nodes, spares) != (self.spec.nodes, self.spec.spares):
            self.spec = self._spec(nodes, spares)
            self.backend = LocalBackend(self.spec)
            self.backends = [self.backend]
            controller.backend = self.backend
        start_run(controller, self.backend, time.time())

    def restart(self, store: StateStore) -> Backend:
        dead = self.backends[-1]
        if dead.lock_fd is not None:  # the dead controller's lock goes with its process
            os.close(dead.lock_fd)
            dead.lock_fd = None
        successor = LocalBackend(self.spec)
        successor.lock_run()
        run = store.run(RUN)
        assert run is not None
        successor.take_up_machines(int(run.generation))
        self.backends.append(successor)
        return successor

    def effects(self) -> list[tuple[str, str, str]]:
        return [(e["backend"], e["request_id"], e["step"]) for e in effects(self.spec)]

    def placement(self) -> dict[int, str]:
        """The rank processes alive now, of every backend instance (a dead controller's must be gone)."""
        return {r.rank: r.node for b in self.backends for r in b.ranks if r.proc.poll() is None}

    def invariants(self) -> None:
        pass

    def close(self) -> None:
        for backend in self.backends:
            backend.close()


class LedgerMachines:
    """A plug-in's backend (``tests.plugin_backend``): machines in a JSON ledger that outlives the controller (a new
    controller's backend reads the same ledger), set up as its controller process does (``take_up``)."""

    name = "ledger"

    def __init__(self, tmp_path: Path) -> None:
        self.config = LedgerConfig(path=str(tmp_path / "ledger.json"))
        self.backend = LedgerBackend(self.config)

    def set_up(self, controller: Controller, nodes: int, spares: int) -> None:
        names = [f"node-{i}" for i in range(nodes + spares)]
        new_ledger(Path(self.config.path), {RUN: LedgerPart(names[:nodes], names[nodes:])})
        take_up(controller, self.backend, time.time())

    def restart(self, store: StateStore) -> Backend:
        return LedgerBackend(self.config)

    def effects(self) -> list[tuple[str, str, str]]:
        return [("ledger", request_id, step) for request_id, step in read_ledger(Path(self.config.path))["effects"]]

    def placement(self) -> dict[int, str]:
        return self.backend.placement(RUN)

    def invariants(self) -> None:
        pass

    def close(self) -> None:
        pass


def machines_of(name: str, request: pytest.FixtureRequest, tmp_path: Path) -> Machines:
    if name == "kubernetes":
        return KubeMachines(request.getfixturevalue("kube"), RUN)
    if name == "ledger":
        return LedgerMachines(tmp_path)
    return FakeMachines() if name == "fake" else LocalMachines(tmp_path)


@pytest.fixture(params=["fake", "kubernetes", "ledger", pytest.param("local", marks=pytest.mark.slow)])
def machines(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Machines]:
    m = machines_of(request.param, request, tmp_path)
    try:
        yield m
    finally:
        m.close()


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_a_failure_gives_the_recorded_actions_each_done_once(
    machines: Machines, store: StateStore, scenario: Scenario
) -> None:
    play(machines, store, scenario)


FAKE_CRASHES = list(scenarios_with_crashes([s.name for s in SCENARIOS]))


@pytest.mark.parametrize(("name", "crash"), FAKE_CRASHES, ids=[f"{n}-{p}-{s}" for n, (p, s) in FAKE_CRASHES])
def test_a_controller_killed_between_any_two_steps_finishes_once_on_the_fake(
    store: StateStore, name: str, crash: tuple[str, int]
) -> None:
    play(FakeMachines(), store, BY_NAME[name], crash)


LOCAL_CRASHES = crash_points(BY_NAME["xid_swap"])


@pytest.mark.slow
@pytest.mark.parametrize("crash", LOCAL_CRASHES, ids=[f"xid_swap-{p}-{s}" for p, s in LOCAL_CRASHES])
def test_a_controller_killed_between_any_two_steps_finishes_once_on_local_processes(
    tmp_path: Path, store: StateStore, crash: tuple[str, int]
) -> None:
    machines = LocalMachines(tmp_path)
    try:
        play(machines, store, BY_NAME["xid_swap"], crash)
    finally:
        machines.close()


@pytest.mark.parametrize(("name", "crash"), FAKE_CRASHES, ids=[f"{n}-{p}-{s}" for n, (p, s) in FAKE_CRASHES])
def test_a_controller_killed_between_any_two_steps_finishes_once_on_a_plug_ins_ledger(
    tmp_path: Path, store: StateStore, name: str, crash: tuple[str, int]
) -> None:
    play(LedgerMachines(tmp_path), store, BY_NAME[name], crash)


KUBE_CRASHES = [(name, point) for name in ("xid_swap", "kill") for point in crash_points(BY_NAME[name])]


@pytest.mark.parametrize(("name", "crash"), KUBE_CRASHES, ids=[f"{n}-{p}-{s}" for n, (p, s) in KUBE_CRASHES])
def test_a_controller_killed_between_any_two_steps_finishes_once_on_kubernetes(
    kube: KubeEmulator, store: StateStore, name: str, crash: tuple[str, int]
) -> None:
    machines = KubeMachines(kube, RUN)
    try:
        play(machines, store, BY_NAME[name], crash)
    finally:
        machines.close()
