"""``opsd run``: a controller (API, detection, recovery) with the local backend, supervising one run to its end.

The run ends when every rank of its launch exits 0 (``completed``), when a recovery fails or it outlives
``timeout_s`` (``failed``), or when ``stop`` is set (``stopped``: SIGINT or SIGTERM to ``opsd run``; the ranks are
killed). A run left ``running``, ``recovering`` or ``waiting_for_spare`` by a controller that died is taken up by
the next ``run_local`` of the same run and state: it kills what the dead one left, restarts the agents, and the
controller goes on with the recovery that was under way (``Recovery.take_up``), skipping the actions already done,
or, when none was, records a ``controller_restart`` incident and relaunches from the newest checkpoint
(``opsd.backends.local.supervise``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from opsd.backends.local.backend import LocalBackend
from opsd.backends.local.spec import LocalRunSpec
from opsd.backends.local.supervise import crash_after, last_reports, start_run
from opsd.controller.controller import Controller
from opsd.controller.rows import as_json
from opsd.protocol.states import RunState
from opsd.runtime.config import ServeConfig
from opsd.runtime.server import Serving, build

log = logging.getLogger(__name__)

OnPoll = Callable[[Controller, LocalBackend, float], None]


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
    controller, credentials = build(config)
    agents = credentials.agent or credentials.operator  # the agents' own token, when the settings give one
    backend = LocalBackend(dataclasses.replace(spec, token=agents))
    controller.backend = backend
    if spec.crash_after_action:
        controller.recovery.on_step = crash_after(spec.crash_after_action)
    serving = Serving(config, controller, credentials)
    serving.start()
    stop = stop or threading.Event()
    started = time.monotonic()
    try:
        start_run(controller, backend, time.time())  # before the first detection pass: a run taken up is recovering
        serving.begin()
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
            for exit_ in exits:
                controller.rank_exited(
                    spec.run, exit_.rank, exit_.node, exit_.code, now, launch=exit_.launch, group=exit_.group
                )
            if done:
                last_reports(controller, spec)
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
        return {
            **as_json(status),
            "incidents": as_json(controller.store.incidents(spec.run)),
            "actions": as_json(controller.store.actions(run=spec.run)),
        }
    finally:
        serving.stop.set()  # no detection pass from here on
        controller.recovery.join(spec.run, timeout_s=60)  # a recovery under way would launch after the stop otherwise
        backend.close()
        serving.close()
