"""The Backend port's contract (tests/backend_contract.py) against the Kubernetes backend, on the emulated API
server with the JobSet controller and scheduler played (tests.kube.jobset): every scenario, and a controller killed
at every point of the XID swap and of the plain restart (its successor: a new backend, informers and reconciler over
the same cluster and state store).

Beyond the contract's checks, each scenario restarts the JobSet once (the pods evicted once, whatever the crash)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from opsd.controller.state import StateStore
from tests.backend_contract import BY_NAME, RUN, SCENARIOS, Scenario, crash_points, play
from tests.kube.emulator import KubeEmulator
from tests.kube.machines import KubeMachines


@pytest.fixture
def machines(kube: KubeEmulator) -> Iterator[KubeMachines]:
    m = KubeMachines(kube, RUN)
    try:
        yield m
    finally:
        m.close()


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_a_failure_gives_the_recorded_actions_each_done_once(
    machines: KubeMachines, store: StateStore, scenario: Scenario
) -> None:
    play(machines, store, scenario)
    assert machines.player.restarts == 1


CRASHES = [(name, point) for name in ("xid_swap", "kill") for point in crash_points(BY_NAME[name])]


@pytest.mark.parametrize(("name", "crash"), CRASHES, ids=[f"{n}-{p}-{s}" for n, (p, s) in CRASHES])
def test_a_controller_killed_between_any_two_steps_finishes_once(
    machines: KubeMachines, store: StateStore, name: str, crash: tuple[str, int]
) -> None:
    play(machines, store, BY_NAME[name], crash)
    assert machines.player.restarts == 1
