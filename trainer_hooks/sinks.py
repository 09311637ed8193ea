"""Where step reports go: the node agent's Unix datagram socket, its UDP port at the node's address (a training pod
with no host directory: ``opsd.protocol.node_agent``), or a JSONL file for runs without an agent.

Sending never blocks and never raises: a report that cannot be delivered is dropped and counted.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from opsd.protocol.env import AGENT_SOCKET_ENV, RANK_KEY_ENV, RUN_ENV
from opsd.protocol.node_agent import AgentAddress, agent_address
from opsd.protocol.rank_auth import headers, sign

log = logging.getLogger(__name__)


class Sink(Protocol):
    dropped: int
    to_agent: bool  # it reaches the node's agent (a file of the reports does not: activities are not sent to it)

    def send(self, data: bytes) -> None: ...

    def close(self) -> None: ...


class DatagramSink:
    """Non-blocking ``AF_UNIX`` / ``SOCK_DGRAM`` sender to ``path`` (no listener, full buffer: dropped, counted)."""

    to_agent = True

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


class UdpSink:
    """Non-blocking UDP sender to the agent at ``host:port``. The socket is connected (no handshake: it only fixes the
    destination), so that the ICMP "port unreachable" of an address where no agent listens is reported at the next
    send, and counted; a full send buffer, an unreachable network, a name that does not resolve: dropped, counted."""

    to_agent = True

    def __init__(self, host: str, port: int, key: str | None = None) -> None:
        """``key``: the run's key (``$OPSD_RANK_KEY``), which signs every datagram (``opsd.protocol.rank_auth``)."""
        self.address = (host, port)
        self.key = key
        self.dropped = 0
        self._warned = False
        self._sock: socket.socket | None = None
        try:  # a name is resolved once, here (status.hostIP is an address: nothing to resolve)
            family, kind, proto, _, target = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
            sock = socket.socket(family, kind, proto)
            sock.setblocking(False)
            sock.connect(target)
            self._sock = sock
        except OSError as exc:
            self._warn(exc)

    def send(self, data: bytes) -> None:
        if self._sock is None:
            self.dropped += 1
            return
        try:
            self._sock.send(sign(data, self.key) if self.key else data)
        except OSError as exc:  # nobody listening (reported by the previous datagram), buffer full, no route
            self.dropped += 1
            self._warn(exc)

    def _warn(self, exc: OSError) -> None:
        if not self._warned:
            self._warned = True
            host, port = self.address
            log.warning("agent at %s:%d unreachable (%s): reports are dropped and counted", host, port, exc)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()


def agent_from_env(environ: Mapping[str, str] = os.environ) -> AgentAddress | None:
    """The agent's address from ``$OPSD_AGENT_HOST``; None when it is not set, or malformed (logged: the rank runs
    on without it)."""
    try:
        return agent_address(environ)
    except ValueError as exc:
        log.warning("no agent at $OPSD_AGENT_HOST: %s", exc)
        return None


def rank_headers(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The headers of a rank's requests to its agent over the network: its run's key (``$OPSD_RANK_KEY``, for the run
    ``$OPSD_RUN``), or none without one."""
    key, run = environ.get(RANK_KEY_ENV, "").strip(), environ.get(RUN_ENV, "").strip()
    return headers(run, key) if key and run else {}


def agent_sink(socket_path: str | None = None, environ: Mapping[str, str] = os.environ) -> Sink | None:
    """The node agent's sink: its Unix socket (``socket_path``, else ``$OPSD_AGENT_SOCKET``), else its UDP port at
    ``$OPSD_AGENT_HOST`` (the datagrams signed with ``$OPSD_RANK_KEY`` when it is set); None when neither is set."""
    path = socket_path or environ.get(AGENT_SOCKET_ENV)
    if path:
        return DatagramSink(path)
    address = agent_from_env(environ)
    key = environ.get(RANK_KEY_ENV, "").strip() or None
    return UdpSink(*address.datagrams, key=key) if address is not None else None


class JsonlSink:
    """Appends each report as one line of ``path``."""

    to_agent = False

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
