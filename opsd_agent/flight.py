"""The agent's uploader of Flight Recorder dumps: from the node's flight directory to the controller.

The node's ranks write their dumps to ``<flight_dir>/<run>/<trigger>/rank-<rank>.json`` (``trainer_hooks.flight``,
atomically: a file with that name is complete). About every ``interval_s`` the uploader POSTs each new one, as it
is, to ``<controller>/v1/runs/<run>/flight-recorder`` with the heartbeats' bearer token (``<run>`` read from the
dump itself), and:

- removes it once the controller answered 2xx (it keeps the dump), and the directories left empty;
- renames it ``*.rejected`` when the controller refused it for good (400, 413, 422: sending it again would not
  help), or when it is not a JSON object naming its run;
- renames it ``*.too_large`` without sending it when it is larger than ``max_bytes`` (64 MiB);
- otherwise (refused connection, timeout, 401, 404, 5xx) leaves it, and tries again after an exponential backoff.

Counted by result (``ok``, ``error``, ``too_large``) in ``opsd_agent_flight_dumps_total``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit

from opsd_agent.reporter import backoff_s

log = logging.getLogger(__name__)

DUMP_NAME = re.compile(r"^rank-\d+\.json$")
HEARTBEAT_PATH = "/v1/heartbeat"
PERMANENT_STATUSES = frozenset({400, 413, 422})


def controller_base(heartbeat_url: str) -> str:
    """The controller's base URL from its heartbeat endpoint (``http://opsd:8470/v1/heartbeat`` ->
    ``http://opsd:8470``); a URL with another path keeps only its scheme and host."""
    url = heartbeat_url.rstrip("/")
    if url.endswith(HEARTBEAT_PATH):
        return url[: -len(HEARTBEAT_PATH)]
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


@dataclass(frozen=True)
class FlightUploaderConfig:
    directory: str
    controller_url: str  # the controller's base URL (``controller_base`` of the heartbeat URL)
    token: str = ""
    interval_s: float = 1.0
    timeout_s: float = 30.0
    max_bytes: int = 64 << 20
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.directory:
            raise ValueError("flight.directory must not be empty")
        if not self.controller_url.startswith(("http://", "https://")):
            raise ValueError("flight.controller_url must be an http:// or https:// URL")
        if self.interval_s <= 0 or self.timeout_s <= 0:
            raise ValueError("flight.interval_s and flight.timeout_s must be > 0")
        if self.max_bytes < 1:
            raise ValueError("flight.max_bytes must be >= 1")
        if self.max_backoff_s < self.interval_s:
            raise ValueError("flight.max_backoff_s must be >= interval_s")


class FlightUploader:
    def __init__(self, config: FlightUploaderConfig, node: str) -> None:
        self.config = config
        self.node = node
        self.ok = 0
        self.errors = 0
        self.too_large = 0
        self.failures = 0  # consecutive failed attempts
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def pending(self) -> list[Path]:
        """The dumps waiting to be sent, oldest first."""
        root = Path(self.config.directory)
        try:
            found = [p for p in root.glob("*/*/rank-*.json") if DUMP_NAME.match(p.name)]
        except OSError:
            return []
        return sorted(found, key=lambda p: (_mtime(p), str(p)))

    def upload_once(self) -> bool:
        """Send every pending dump; False when one could not be delivered (the rest wait for the next attempt)."""
        for path in self.pending():
            if not self._send(path):
                self.failures += 1
                return False
        self.failures = 0
        return True

    def _send(self, path: Path) -> bool:
        """Deliver or set aside one dump; False when it is worth trying again later."""
        try:
            size = path.stat().st_size
            if size > self.config.max_bytes:
                self.too_large += 1
                log.warning("flight dump %s skipped: %d bytes > %d", path, size, self.config.max_bytes)
                _set_aside(path, "too_large")
                return True
            data = path.read_bytes()
            run = json.loads(data).get("run")
            if not isinstance(run, str) or not run:
                raise ValueError("no run")
        except FileNotFoundError:
            return True  # gone meanwhile
        except (OSError, ValueError, AttributeError) as exc:
            self.errors += 1
            log.warning("flight dump %s is not a dump (%s): set aside", path, exc)
            _set_aside(path, "rejected")
            return True
        url = f"{self.config.controller_url}/v1/runs/{quote(run, safe='')}/flight-recorder"
        headers = {"Content-Type": "application/json"}
        if self.config.token:
            headers["Authorization"] = f"Bearer {self.config.token}"
        request = urllib.request.Request(url, data=data, method="POST", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.config.timeout_s) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            self.errors += 1
            detail = exc.read()[:500].decode(errors="replace")
            if exc.code in PERMANENT_STATUSES:
                log.warning("flight dump %s refused by the controller (%d %s): set aside", path, exc.code, detail)
                _set_aside(path, "rejected")
                return True
            log.warning("flight dump %s not delivered (%d %s); trying again later", path, exc.code, detail)
            return False
        except (urllib.error.URLError, OSError) as exc:
            self.errors += 1
            log.warning("flight dump %s not delivered (%s); trying again later", path, exc)
            return False
        self.ok += 1
        path.unlink(missing_ok=True)
        for directory in (path.parent, path.parent.parent):  # the trigger's and the run's, once empty
            try:
                directory.rmdir()
            except OSError:
                break
        log.info("flight dump %s delivered to %s", path, url)
        return True

    def start(self) -> None:
        def loop() -> None:
            delay = 0.0
            while not self._stop.wait(delay):
                try:
                    self.upload_once()
                except Exception:  # the uploader must outlive anything a dump directory holds
                    self.failures += 1
                    log.exception("flight dump upload failed")
                delay = backoff_s(self.failures, self.config.interval_s, self.config.max_backoff_s, random.random())

        self._thread = threading.Thread(target=loop, name="opsd-agent-flight", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.config.timeout_s + 2)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return time.time()


def _set_aside(path: Path, why: str) -> None:
    try:
        os.replace(path, path.with_name(f"{path.name}.{why}"))
    except OSError as exc:
        log.warning("cannot set %s aside: %s", path, exc)
