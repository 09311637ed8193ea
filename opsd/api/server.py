"""``opsd serve``: the controller's API on uvicorn, with a detection pass every ``tick_interval_s``."""

from __future__ import annotations

import gc
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn

from opsd.api.app import create_app
from opsd.controller.config import ControllerConfig
from opsd.controller.controller import Controller
from opsd.controller.state import StateStore
from opsd.controller.tracing import IncidentTracing
from opsd.errors import ConfigError, OpsError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeConfig:
    """``opsd serve``'s settings: where the API listens, where the state is, and the controller's configuration (its
    fields are set at the same level of the settings file: ``controller.hang_floor_s`` is
    ``controller.detection.hang_floor_s``'s neighbour; docs/configuration.md)."""

    host: str = "127.0.0.1"
    port: int = 8470
    state_dir: str = ".opsd"
    state_url: str = ""  # default: sqlite:///<state_dir>/opsd.db
    token: str = ""  # default: <state_dir>/token, created once
    tick_interval_s: float = 0.5  # between two detection passes
    controller: ControllerConfig = field(default_factory=ControllerConfig, metadata={"inline": True})

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("controller.port must be in 0..65535")
        if self.tick_interval_s <= 0:
            raise ValueError("controller.tick_interval_s must be > 0")


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


def build(config: ServeConfig) -> tuple[Controller, str]:
    Path(config.state_dir).mkdir(parents=True, exist_ok=True)
    url = config.state_url or f"sqlite:///{Path(config.state_dir) / 'opsd.db'}"
    tracing = IncidentTracing.from_environment()  # OTEL_EXPORTER_OTLP_ENDPOINT: each incident a trace
    return Controller(StateStore.open(url), config.controller, tracing=tracing), load_token(config)


def tick_forever(controller: Controller, interval_s: float, stop: threading.Event) -> None:
    while not stop.wait(interval_s):
        try:
            controller.tick(time.time())
        except OpsError as exc:
            log.warning("detection pass skipped: %s", exc)
        except Exception:
            log.exception("detection pass failed")


def tune_interpreter() -> None:
    """For a process whose event loop takes thousands of heartbeats a second beside a detection thread, and holds
    hundreds of thousands of long-lived objects (the live records of 24,576 ranks):

    - the young generations are collected on a schedule (``collect_young``): each request leaves objects that live
      until the next request on its keep-alive connection, and as each of those is freed the collector counts one
      allocation less, so left to itself it puts its young collections off until they hold ~45,000 objects
      (25-35 ms pauses);
    - a full collection waits for 10,000 collections of the middle generation rather than 10: every several
      minutes at 3,000 requests a second, not every 2 to 3 seconds (each takes ~150 ms over the long-lived objects
      at that scale; the controller's records hold no reference cycles, they are freed as they go);
    - what is built at start (modules, the app) is moved out of the collector's way (``gc.freeze``)."""
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, 10_000)
    gc.collect()
    gc.freeze()


def collect_young(interval_s: float, stop: threading.Event) -> None:
    """Collect the two young generations every ``interval_s``: pauses of a few milliseconds."""
    while not stop.wait(interval_s):
        gc.collect(1)


def run_server(config: ServeConfig) -> None:
    controller, token = build(config)
    stop = threading.Event()
    ticker = threading.Thread(target=tick_forever, args=(controller, config.tick_interval_s, stop), daemon=True)
    ticker.start()
    server = uvicorn.Server(
        uvicorn.Config(create_app(controller, token), host=config.host, port=config.port, log_level="warning")
    )
    tune_interpreter()
    threading.Thread(target=collect_young, args=(0.1, stop), name="gc", daemon=True).start()
    log.info("opsd controller on http://%s:%d (OpenAPI at /openapi.json)", config.host, config.port)
    try:
        server.run()
    finally:
        stop.set()
        controller.tracing.shutdown()  # the traces still queued exported
