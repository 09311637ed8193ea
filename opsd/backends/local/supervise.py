"""Supervising a run on the local backend: registering it (its nodes, agents and first launch) or taking it up from
a controller that died, and what the supervisor does around a run's end. ``opsd.runtime.local`` is the process
(``opsd run``) that does it beside the API."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable

from opsd.backends.local.backend import LocalBackend
from opsd.backends.local.spec import LocalNodes, LocalRunSpec
from opsd.controller.controller import Controller
from opsd.controller.recovery import COMPLETED
from opsd.controller.state import Action
from opsd.errors import PermanentError
from opsd.protocol.states import NodeRole, RunState

log = logging.getLogger(__name__)


def start_run(controller: Controller, backend: LocalBackend, now_s: float) -> None:
    """Register the run and its nodes, start an agent per node, launch the first generation; or take the run up
    when the state store has it unfinished (its controller stopped)."""
    spec, store = backend.spec, controller.store
    existing = store.run(spec.run)
    if existing is not None and RunState(existing.state).finished:
        raise PermanentError(
            f"run {spec.run!r} is {existing.state} in this state store; give another --run or --state-dir"
        )
    backend.lock_run()
    if existing is not None:
        recorded = existing.spec.own_as(LocalNodes)
        if (recorded.nodes, recorded.spares) != (spec.nodes, spec.spares):
            raise PermanentError(
                f"run {spec.run!r} was started with --nodes {recorded.nodes} --spares {recorded.spares};"
                " take it up with the same"
            )
        store.update_run(spec.run, now_s, state=RunState.RECOVERING)  # before the first detection pass
        generation = int(existing.generation)
        killed = backend.take_up_machines(generation)
        why = f"the run's controller stopped during generation {generation}; {killed} processes it left killed"
        controller.recovery.take_up(existing, now_s, why)
        return
    store.create_run(spec.run, spec.recorded(), now_s)
    for i, node in enumerate(spec.node_names()):
        role = NodeRole.ACTIVE if i < spec.nodes else NodeRole.SPARE
        store.upsert_node(node, now_s, run=spec.run, role=role, domain=f"rack{i % 2}")
    backend.start_agents()
    controller.recovery.launch_first(spec.run, now_s)


def crash_after(kind: str) -> Callable[[str, Action], None]:
    """Fault injection (tests): SIGKILL this process once a recovery step of ``kind`` is recorded done."""

    def on_step(point: str, action: Action) -> None:
        if point == COMPLETED and action.kind == kind:
            log.critical("run %s: killing this controller after %s (fault injection)", action.run, action.request_id)
            os.kill(os.getpid(), signal.SIGKILL)

    return on_step


def last_reports(controller: Controller, spec: LocalRunSpec) -> None:
    """Every rank exited 0: let the agents' last heartbeats bring their final steps in (a few intervals)."""
    seen = -1
    for _ in range(10):
        time.sleep(spec.heartbeat_interval_s * 1.5)
        controller.tick(time.time())
        run = controller.store.run(spec.run)
        step = int(run.last_step) if run else -1
        if step == seen:
            return
        seen = step
