"""``opsd run``: a controller (API, detection) with the local backend, supervising one run to its end.

The run ends when every rank of its launch exits 0 (``completed``), when a recovery fails or it outlives
``timeout_s`` (``failed``), or when ``stop`` is set (``stopped``: SIGINT or SIGTERM to ``opsd run``; the ranks are
killed). A run left ``running``, ``recovering`` or ``waiting_for_spare`` by a controller that died is taken up by
the next ``run_local`` of the same run and state (``LocalBackend.take_up``)."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn

from opsd.api.app import create_app
from opsd.api.server import ServeConfig, build, tick_forever
from opsd.backends.local.backend import LocalBackend, LocalRunSpec
from opsd.controller.controller import Controller
from opsd.errors import OpsError

log = logging.getLogger(__name__)

OnPoll = Callable[[Controller, LocalBackend, float], None]


def start_api(controller: Controller, token: str, host: str, port: int) -> uvicorn.Server:
    """The API on a thread of its own; returns once it listens."""
    app = create_app(controller, token)
    app.state.backend = controller.backend
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    threading.Thread(target=server.run, name="opsd-api", daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise OpsError(f"the API did not start on {host}:{port}")
        time.sleep(0.05)
    return server


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
    backend = LocalBackend(dataclasses.replace(spec, token=token))  # the agents use the controller's token
    controller.backend = backend
    server = start_api(controller, token, config.host, config.port)
    ticking = threading.Event()
    stop = stop or threading.Event()
    started = time.monotonic()
    try:
        backend.start(controller, time.time())  # before the first detection pass: a run taken up is "recovering"
        threading.Thread(target=tick_forever, args=(controller, config.tick_interval_s, ticking), daemon=True).start()
        while True:
            stop.wait(poll_s)
            now = time.time()
            if stop.is_set():
                backend.stop_ranks()
                controller.store.update_run(spec.run, now, state="stopped")
                log.warning("run %s: stopped on request", spec.run)
                break
            if on_poll is not None:
                on_poll(controller, backend, now)
            run = controller.store.run(spec.run)
            assert run is not None
            if run["state"] == "failed":
                break
            if run["state"] == "running" and backend.supervise(controller, now):
                _last_reports(controller, spec)
                final = controller.store.run(spec.run)
                assert final is not None
                controller.store.update_run(spec.run, now, state="completed", final_step=final["last_step"])
                log.info("run %s: completed at step %d", spec.run, final["last_step"])
                break
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                controller.store.update_run(spec.run, now, state="failed")
                log.error("run %s: did not finish within %.0f s", spec.run, timeout_s)
                break
        status = controller.status(spec.run, time.time())
        assert status is not None
        status["incidents"] = controller.store.incidents(spec.run)
        status["actions"] = [a.__dict__ for a in controller.store.actions(run=spec.run)]
        return status
    finally:
        ticking.set()
        backend.close()
        server.should_exit = True


def _last_reports(controller: Controller, spec: LocalRunSpec) -> None:
    """Every rank exited 0: let the agents' last heartbeats bring their final steps in (a few intervals)."""
    seen = -1
    for _ in range(10):
        time.sleep(spec.heartbeat_interval_s * 1.5)
        controller.tick(time.time())
        run = controller.store.run(spec.run)
        step = int(run["last_step"]) if run else -1
        if step == seen:
            return
        seen = step
