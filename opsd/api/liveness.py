"""The liveness datagrams' endpoint: a UDP socket on the API's event loop (``opsd.protocol.liveness``).

Each datagram is checked (size, version, and its tag: signed with the key of an agent's or an operator's token, the
roles that may send heartbeats), handed to the controller (which refuses a replay or a clock too far off), and
acknowledged to its sender, who falls back to heartbeats over HTTP when its datagrams go unacknowledged. A datagram
costs the loop ~10 us: 12,288 nodes a second are ~15% of a core. What is refused is counted by reason
(``opsd_controller_liveness_refused_total``) and dropped; nothing a sender does stops the endpoint.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any

from opsd.api.auth import Credentials
from opsd.controller.controller import Controller
from opsd.controller.metrics import ApiStats
from opsd.protocol.liveness import (
    MAX_DATAGRAM_BYTES,
    LivenessError,
    Signer,
    decode_alive,
    encode_ack,
    liveness_key,
)

log = logging.getLogger(__name__)

#: room for ~10,000 datagrams queued while the loop is busy elsewhere (the kernel caps it at net.core.rmem_max)
RECEIVE_BUFFER_BYTES = 4 << 20


#: datagrams taken per wake-up of the loop at most (~15 ms of work), so that the HTTP requests get their turn
DRAIN_MAX = 1024


class LivenessEndpoint:
    """The UDP socket's reader on the event loop: at each wake-up it takes every datagram queued (up to
    ``DRAIN_MAX``). Not an ``asyncio.DatagramProtocol``: uvloop's datagram transport reads at most 32 datagrams per
    turn of the loop, and a turn that also answers HTTP heartbeats takes several milliseconds: 12,288 datagrams a
    second overflowed the socket's queue."""

    def __init__(
        self,
        sock: socket.socket,
        controller: Controller,
        credentials: Credentials,
        stats: ApiStats,
        clock: Callable[[], float],
    ) -> None:
        self.sock = sock
        self.controller = controller
        self.signers = [Signer(liveness_key(t)) for t in (credentials.agent, credentials.operator) if t]
        self.stats = stats
        self.clock = clock

    def readable(self) -> None:
        for _ in range(DRAIN_MAX):
            try:
                data, addr = self.sock.recvfrom(MAX_DATAGRAM_BYTES + 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # an acknowledgement that found no one (ICMP unreachable), reported here
                log.debug("liveness endpoint: %s", exc)
                continue
            self.take(data, addr)

    def take(self, data: bytes, addr: Any) -> None:
        try:
            node, seq, tag = decode_alive(data, self.signers)
        except LivenessError as exc:
            self.stats.refuse_datagram(exc.reason)
            return
        refused = self.controller.alive(node, seq, self.clock())
        if refused is not None:
            self.stats.refuse_datagram(refused)
            return
        try:
            self.sock.sendto(encode_ack(seq, tag), addr)
        except OSError as exc:  # a full send buffer: the agent's next datagram is acknowledged instead
            log.debug("liveness acknowledgement to %s: %s", addr, exc)


async def open_liveness(
    controller: Controller,
    credentials: Credentials,
    stats: ApiStats,
    clock: Callable[[], float],
    host: str,
    port: int,
) -> socket.socket | None:
    """Take liveness datagrams on ``host:port`` (0: any free port) on the running loop; the controller's replies
    name the port from then on. None when the port cannot be bound: agents then send their liveness over HTTP."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
        sock.bind((host, port))
        sock.setblocking(False)
        endpoint = LivenessEndpoint(sock, controller, credentials, stats, clock)
        asyncio.get_running_loop().add_reader(sock.fileno(), endpoint.readable)
    except OSError as exc:
        sock.close()
        log.error("no liveness datagrams on udp %s:%d (%s): agents send their liveness over HTTP", host, port, exc)
        return None
    controller.liveness_port = int(sock.getsockname()[1])
    log.info("liveness datagrams on udp %s:%d", host, controller.liveness_port)
    return sock


def close_liveness(controller: Controller, sock: socket.socket | None) -> None:
    controller.liveness_port = None
    if sock is not None:
        asyncio.get_running_loop().remove_reader(sock.fileno())
        sock.close()
