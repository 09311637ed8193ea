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
from typing import cast

from opsd.api.auth import Credentials
from opsd.controller.controller import Controller
from opsd.controller.metrics import ApiStats
from opsd.protocol.liveness import LivenessError, Signer, decode_alive, encode_ack, liveness_key

log = logging.getLogger(__name__)

#: room for ~10,000 datagrams queued while the loop is busy elsewhere (the kernel caps it at net.core.rmem_max)
RECEIVE_BUFFER_BYTES = 4 << 20


class LivenessEndpoint(asyncio.DatagramProtocol):
    def __init__(
        self, controller: Controller, credentials: Credentials, stats: ApiStats, clock: Callable[[], float]
    ) -> None:
        self.controller = controller
        self.signers = [Signer(liveness_key(t)) for t in (credentials.agent, credentials.operator) if t]
        self.stats = stats
        self.clock = clock
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)  # uvloop's is not a subclass of asyncio's

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        try:
            node, seq, tag = decode_alive(data, self.signers)
        except LivenessError as exc:
            self.stats.refuse_datagram(exc.reason)
            return
        refused = self.controller.alive(node, seq, self.clock())
        if refused is not None:
            self.stats.refuse_datagram(refused)
            return
        if self.transport is not None:
            self.transport.sendto(encode_ack(seq, tag), addr)

    def error_received(self, exc: Exception) -> None:
        log.debug("liveness endpoint: %s", exc)  # an acknowledgement that found no one (ICMP unreachable)


async def open_liveness(
    controller: Controller,
    credentials: Credentials,
    stats: ApiStats,
    clock: Callable[[], float],
    host: str,
    port: int,
) -> asyncio.DatagramTransport | None:
    """Take liveness datagrams on ``host:port`` (0: any free port) on the running loop; the controller's replies
    name the port from then on. None when the port cannot be bound: agents then send their liveness over HTTP."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
        sock.bind((host, port))
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: LivenessEndpoint(controller, credentials, stats, clock), sock=sock
        )
    except OSError as exc:
        sock.close()
        log.error("no liveness datagrams on udp %s:%d (%s): agents send their liveness over HTTP", host, port, exc)
        return None
    controller.liveness_port = int(sock.getsockname()[1])
    log.info("liveness datagrams on udp %s:%d", host, controller.liveness_port)
    return transport


def close_liveness(controller: Controller, transport: asyncio.DatagramTransport | None) -> None:
    controller.liveness_port = None
    if transport is not None:
        transport.close()
