"""A controller's process: its settings (``ServeConfig``), the controller and credentials they make (``build``), and
one way to serve them (``Serving``: the API on uvicorn beside the controller's work), whatever the backend."""

from __future__ import annotations

import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import uvicorn

from opsd.api.app import create_app
from opsd.api.auth import Credentials
from opsd.api.heartbeat_ingest import HeartbeatPort
from opsd.api.interpreter import YOUNG_EVERY_S, collect_young, tune_collector
from opsd.api.tls import CertificateReload
from opsd.controller.controller import Controller
from opsd.controller.port import Backend
from opsd.controller.state import StateStore
from opsd.controller.tracing import IncidentTracing
from opsd.errors import ConfigError, OpsError
from opsd.runtime.config import ServeConfig

log = logging.getLogger(__name__)

#: connections waiting to be accepted: the agents of a 12,288-node job connect within a second when it starts or the
#: controller restarts (uvicorn's default, 2048, leaves the others to retry their SYN after 1, 3, 7 s...); the
#: kernel caps it at net.core.somaxconn (4096 on most)
BACKLOG = 16384
SWITCH_INTERVAL_S = 0.001


def load_token(config: ServeConfig) -> str:
    """The configured token, or the one in ``<state_dir>/token`` (made, readable by its owner only, if missing)."""
    if config.token:
        return config.token
    path = Path(config.state_dir) / "token"
    try:
        if path.exists():
            return path.read_text().strip()
        path.parent.mkdir(parents=True, exist_ok=True)
        token = secrets.token_urlsafe(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        log.info("a new API token was written to %s", path)
        return token
    except OSError as exc:
        raise ConfigError(f"token file {path}: {exc}") from None


def credentials(config: ServeConfig) -> Credentials:
    """Every role's token (``opsd.api.auth``): the operators' from ``load_token``, the others as configured."""
    try:
        return Credentials(
            load_token(config),
            config.reader_token,
            config.agent_token,
            config.metrics_token,
            config.previous_token,
            config.previous_reader_token,
            config.previous_agent_token,
            config.previous_metrics_token,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def build(config: ServeConfig) -> tuple[Controller, Credentials]:
    Path(config.state_dir).mkdir(parents=True, exist_ok=True)
    url = config.state_url or f"sqlite:///{Path(config.state_dir) / 'opsd.db'}"
    tracing = IncidentTracing.from_environment()  # OTEL_EXPORTER_OTLP_ENDPOINT: each incident a trace
    return Controller(StateStore.open(url), config.controller, tracing=tracing), credentials(config)


def tune_interpreter() -> None:
    """For a process whose event loop takes thousands of heartbeats a second beside a detection thread: the collector
    tuned (``opsd.api.interpreter``), and a thread waiting for the interpreter lock gets it within 1 ms rather than
    5 ms (``sys.setswitchinterval``): the event loop gives the lock up at every socket call, and while the detection
    thread computes, each time it wants it back it waited up to 5 ms (a heartbeat or a datagram held up that long,
    many times over)."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    tune_collector()


def collect_young_every(interval_s: float, stop: threading.Event) -> None:
    while not stop.wait(interval_s):
        collect_young()


Lead = Callable[[threading.Event], None]


class Serving:
    """A controller's process: the API on uvicorn (over HTTPS when the settings name a certificate and its key),
    the controller's work on a thread of its own (``lead``: the detection pass every ``tick_interval_s`` unless a
    backend leads otherwise, e.g. a Kubernetes leader's informers first), the collector's schedule, and the
    incidents' traces flushed at the end. ``run`` does it all in this thread until the server stops; ``start``
    serves the API in a thread of its own and returns once it listens, and ``begin`` starts the controller's work
    (``opsd run`` registers its run in between, and supervises it meanwhile)."""

    def __init__(
        self,
        config: ServeConfig,
        controller: Controller,
        credentials: Credentials | str,
        *,
        lead: Lead | None = None,
        describe: str = "",
    ) -> None:
        self.config = config
        self.controller = controller
        self.stop = threading.Event()
        self._threads: list[threading.Thread] = []  # the controller's work and the API's, joined by close
        self.lead = lead or (lambda stop: controller.tick_every(config.tick_interval_s, stop))
        self.describe = describe
        liveness = (config.host, config.liveness_port) if config.liveness_port is not None else None
        heartbeats = None
        if config.heartbeat_port is not None:
            heartbeats = HeartbeatPort(
                config.host,
                config.heartbeat_port,
                config.keep_alive_s,
                config.tls_certfile,
                config.tls_keyfile,
                config.tls_reload_every_s,
            )
        self.server = uvicorn.Server(
            uvicorn.Config(
                create_app(
                    controller,
                    credentials,
                    liveness=liveness,
                    heartbeats=heartbeats,
                    background=[self._reload_certificate] if config.tls_certfile else [],
                ),
                host=config.host,
                port=config.port,
                log_level="warning",
                access_log=False,
                timeout_keep_alive=int(config.keep_alive_s),
                backlog=BACKLOG,
                ssl_certfile=config.tls_certfile or None,
                ssl_keyfile=config.tls_keyfile or None,
            )
        )

    async def _reload_certificate(self) -> None:
        """The API's certificate loaded again when its files change (``opsd.api.tls``); uvicorn made the context
        before the app started."""
        context = self.server.config.ssl
        if context is not None:
            reload = CertificateReload(context, self.config.tls_certfile, self.config.tls_keyfile)
            await reload.every(self.config.tls_reload_every_s)

    @property
    def url(self) -> str:
        scheme = "https" if self.config.tls_certfile else "http"
        return f"{scheme}://{self.config.host}:{self.config.port}"

    def begin(self) -> None:
        """Start the controller's work (``lead``) and the collector's schedule."""
        self._threads.append(threading.Thread(target=self.lead, args=(self.stop,), name="opsd-controller", daemon=True))
        self._threads[-1].start()
        tune_interpreter()
        threading.Thread(target=collect_young_every, args=(YOUNG_EVERY_S, self.stop), name="gc", daemon=True).start()
        log.info("opsd controller on %s%s (OpenAPI at /openapi.json)", self.url, self.describe)

    def run(self) -> None:
        """Serve until the server stops (a signal); then close."""
        self.begin()
        try:
            self.server.run()
        finally:
            self.close()

    def start(self, timeout_s: float = 30.0) -> None:
        """Serve the API in a thread of its own; returns once it listens (``begin`` starts the controller's
        work)."""
        self._threads.append(threading.Thread(target=self.server.run, name="opsd-api", daemon=True))
        self._threads[-1].start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline:
                raise OpsError(f"the API did not start on {self.config.host}:{self.config.port}")
            time.sleep(0.05)

    def close(self, join_s: float = 10.0) -> None:
        """Stop the controller's work and the API, and wait (up to ``join_s``) for their threads: a pass or a request
        left running while the process exits may be inside the state store's driver when the interpreter finalizes
        (``opsd run`` died of SIGSEGV after its run had completed)."""
        self.stop.set()
        self.server.should_exit = True
        current = threading.current_thread()
        for thread in self._threads:
            if thread is not current:
                thread.join(join_s)
        self.controller.tracing.shutdown()  # the traces still queued exported


def run_server(
    config: ServeConfig, backend: Backend | None = None, *, before: Callable[[Controller], None] | None = None
) -> None:
    """``opsd serve`` with ``backend`` (a backend's controller process that needs no more, as a plug-in's), or
    without one (``none``: incidents are recorded, nothing is recovered). ``before``: what the backend does with the
    controller before it serves (find its runs)."""
    controller, credentials = build(config)
    controller.backend = backend
    if before is not None:
        before(controller)
    Serving(config, controller, credentials).run()
