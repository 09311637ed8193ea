"""Where step reports go: the node agent's Unix datagram socket, or a JSONL file for runs without an agent.

Sending never blocks and never raises: a report that cannot be delivered is dropped and counted.
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)


class Sink(Protocol):
    dropped: int

    def send(self, data: bytes) -> None: ...

    def close(self) -> None: ...


class DatagramSink:
    """Non-blocking ``AF_UNIX`` / ``SOCK_DGRAM`` sender to ``path`` (no listener, full buffer: dropped, counted)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.dropped = 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._warned = False

    def send(self, data: bytes) -> None:
        try:
            self._sock.sendto(data, self.path)
        except OSError as exc:  # no socket file, nobody listening, buffer full, message too long
            self.dropped += 1
            if not self._warned:
                self._warned = True
                log.warning("agent socket %s unavailable (%s): reports are dropped and counted", self.path, exc)

    def close(self) -> None:
        self._sock.close()


class JsonlSink:
    """Appends each report as one line of ``path``."""

    def __init__(self, path: str | Path) -> None:
        self.dropped = 0
        self._file = open(path, "ab")  # noqa: SIM115 - held open for the run

    def send(self, data: bytes) -> None:
        try:
            self._file.write(data + b"\n")
            self._file.flush()
        except OSError:
            self.dropped += 1

    def close(self) -> None:
        self._file.close()
