"""``opsd run``: a controller (API, detection, recovery) with the local backend, supervising one run to its end.

The run ends when every rank of its launch exits 0 (``completed``), when a recovery fails or it outlives
``timeout_s`` (``failed``), or when ``stop`` is set (``stopped``: SIGINT or SIGTERM to ``opsd run``; the ranks are
killed). A run left ``running``, ``recovering`` or ``waiting_for_spare`` by a controller that died is taken up by
the next ``run_local`` of the same run and state: it kills what the dead one left, restarts the agents, and the
controller goes on with the recovery that was under way (``Recovery.take_up``), skipping the actions already done,
or, when none was, records a ``controller_restart`` incident and relaunches from the newest checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn

from opsd.api.app import create_app
from opsd.api.auth import Credentials
from opsd.api.server import ServeConfig, build, tick_forever
from opsd.backends.local.backend import LocalBackend
from opsd.backends.local.spec import LocalRunSpec
from opsd.controller.controller import Controller
from opsd.controller.recovery import COMPLETED
from opsd.controller.rows import as_json
from opsd.controller.state import Action
from opsd.errors import OpsError, PermanentError
from opsd.protocol.states import NodeRole, RunState

log = logging.getLogger(__name__)

OnPoll = Callable[[Controller, LocalBackend, float], None]


def start_api(controller: Controller, token: str | Credentials, host: str, port: int) -> uvicorn.Server:
    """The API on a thread of its own (``token``: the operators', or every role's); returns once it listens."""
    server = uvicorn.Server(uvicorn.Config(create_app(controller, token), host=host, port=port, log_level="warning"))
    threading.Thread(target=server.run, name="opsd-api", daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise OpsError(f"the API did not start on {host}:{port}")
        time.sleep(0.05)
    return server


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
        recorded = existing.spec
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


def run_local(
    config: ServeConfig,
    spec: LocalRunSpec,
    *,
    poll_s: float = 0.25,
    timeout_s: float | None = None,
    on_poll: OnPoll | None = None,
    stop: threading.Event | None = None,
) -> dict[str, Any]:
    """Run ``spec`` to its end (every rank exited 0, the run failed, or ``stop`` was set); returns its final
    status."""
    controller, token = build(config)
    agents = token.agent or token.operator  # the agents' own token, when the settings give one
    backend = LocalBackend(dataclasses.replace(spec, token=agents))
    controller.backend = backend
    if spec.crash_after_action:
        controller.recovery.on_step = crash_after(spec.crash_after_action)
    server = start_api(controller, token, config.host, config.port)
    ticking = threading.Event()
    stop = stop or threading.Event()
    started = time.monotonic()
    try:
        start_run(controller, backend, time.time())  # before the first detection pass: a run taken up is recovering
        threading.Thread(target=tick_forever, args=(controller, config.tick_interval_s, ticking), daemon=True).start()
        while True:
            stop.wait(poll_s)
            now = time.time()
            if stop.is_set():
                backend.kill_ranks()
                controller.store.update_run(spec.run, now, state=RunState.STOPPED)
                log.warning("run %s: stopped on request", spec.run)
                break
            if on_poll is not None:
                on_poll(controller, backend, now)
            run = controller.store.run(spec.run)
            assert run is not None
            if run.state == RunState.FAILED:
                break
            exits, done = backend.supervise() if run.state == RunState.RUNNING else ([], False)
            for rank, node, code in exits:
                controller.rank_exited(spec.run, rank, node, code, now)
            if done:
                _last_reports(controller, spec)
                final = controller.final_step(spec.run)
                controller.store.update_run(spec.run, now, state=RunState.COMPLETED, final_step=final)
                log.info("run %s: completed at step %d", spec.run, final)
                controller.tick(time.time())  # its incidents settled (a last launch may have said nothing)
                break
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                controller.store.update_run(spec.run, now, state=RunState.FAILED)
                log.error("run %s: did not finish within %.0f s", spec.run, timeout_s)
                break
        ended = controller.store.run(spec.run)
        assert ended is not None
        controller.record_launch(spec.run, int(ended.generation), time.time())  # what it measured, kept
        status = controller.status(spec.run, time.time())
        assert status is not None
        status["incidents"] = as_json(controller.store.incidents(spec.run))
        status["actions"] = as_json(controller.store.actions(run=spec.run))
        return status
    finally:
        ticking.set()
        controller.recovery.join(spec.run, timeout_s=60)  # a recovery under way would launch after the stop otherwise
        backend.close()
        server.should_exit = True
        controller.tracing.shutdown()  # the traces still queued exported


def _last_reports(controller: Controller, spec: LocalRunSpec) -> None:
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
