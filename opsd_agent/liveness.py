"""The node's liveness datagrams to the controller (``opsd.protocol.liveness``), and whether they get there.

The controller acknowledges each datagram it takes. A datagram still unacknowledged ``wait_s`` after it was sent
(two beats) means the datagrams do not get through (a firewall, a network policy without UDP, a controller whose
port is not reachable, a clock too far off): the reporter then sends its liveness over HTTP, and keeps sending
datagrams, so that it goes back to them as soon as one is acknowledged again. Sending never blocks: the socket is
non-blocking, and a datagram the kernel cannot send now is counted as an error.
"""

from __future__ import annotations

import logging
import socket

from opsd.protocol.liveness import LivenessError, Signer, decode_ack, encode_alive, liveness_key

log = logging.getLogger(__name__)

MAX_PENDING = 64  # datagrams awaiting their acknowledgement (older ones are forgotten)


class LivenessSender:
    """Datagrams from ``node`` to ``host:port`` signed with the key of ``token``."""

    def __init__(self, node: str, token: str, host: str, port: int, wait_s: float) -> None:
        self.node = node
        self.port = port
        self.wait_s = wait_s
        self.signer = Signer(liveness_key(token))
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        self.sock = socket.socket(family, kind, proto)
        self.sock.setblocking(False)
        self.sock.connect(address)  # only the controller's datagrams are received; an ICMP refusal is reported
        self.seq = 0
        self.pending: dict[bytes, float] = {}  # tag -> when it was sent (monotonic), oldest first
        self.sent = self.acknowledged = self.errors = 0

    def send(self, now_s: float, mono_s: float) -> None:
        """One datagram (its seq: the clock in milliseconds, strictly increasing)."""
        self.seq = max(self.seq + 1, int(now_s * 1000))
        data = encode_alive(self.node, self.seq, self.signer)
        try:
            self.sock.send(data)
        except OSError as exc:  # refused (nobody listens: ICMP), no route, the buffer full
            self.errors += 1
            log.debug("liveness datagram to port %d: %s", self.port, exc)
        else:
            self.sent += 1
        self.pending[data[-16:]] = mono_s  # counted as not acknowledged either way
        while len(self.pending) > MAX_PENDING:
            del self.pending[next(iter(self.pending))]

    def receive(self) -> None:
        """Take the acknowledgements that came: each one settles its datagram and every older one."""
        for _ in range(4 * MAX_PENDING):
            try:
                data = self.sock.recv(64)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # an ICMP refusal of an earlier datagram
                log.debug("liveness acknowledgements from port %d: %s", self.port, exc)
                continue
            try:
                _, tag = decode_ack(data)
            except LivenessError:
                continue
            if tag in self.pending:
                self.acknowledged += 1
                for older in list(self.pending):
                    del self.pending[older]
                    if older == tag:
                        break

    def lost(self, mono_s: float) -> bool:
        """Whether a datagram has gone unacknowledged for ``wait_s``."""
        oldest = next(iter(self.pending.values()), None)
        return oldest is not None and mono_s - oldest >= self.wait_s

    def close(self) -> None:
        self.sock.close()
