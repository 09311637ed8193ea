"""The liveness datagram: a node agent's sign of life, sent every second over UDP beside its heartbeats, and the
controller's acknowledgement (docs/protocol.md, "Liveness datagram").

At 12,288 nodes a heartbeat a second over HTTP costs the controller more than a core in the HTTP server alone; a
datagram of ~40 bytes costs it a few microseconds. So an agent that has been told the controller's datagram port
says "alive" by datagram every second, and sends its ranks over HTTP only at the interval the controller asks for.

Every datagram is signed: the first 16 bytes of HMAC-SHA256 (RFC 2104) over what precedes the tag, keyed with
``liveness_key(token)``, the agent's bearer token (``opsd.api.auth``) turned into a key of its own. ``seq`` is the
sender's wall clock in milliseconds, strictly increasing: the controller refuses a ``seq`` it has seen from the node
(a replay) or one too far from its own clock. The acknowledgement echoes the tag of the datagram it acknowledges
(only one who saw the datagram can forge it, and one who sees the datagrams can drop them anyway).

Layout (big-endian)::

    alive: "opsL" | version (1 byte) | kind 1 (1) | seq (8) | node length (1) | node (UTF-8) | tag (16)
    ack:   "opsL" | version (1 byte) | kind 2 (1) | seq (8) | tag of the datagram acknowledged (16)

Pure: bytes in, bytes out; the callers own the sockets.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import struct
from collections.abc import Sequence

from opsd.errors import PermanentError

MAGIC = b"opsL"
VERSION = 1
ALIVE, ACK = 1, 2
TAG_BYTES = 16
MAX_NODE_BYTES = 200
_HEAD = struct.Struct("!4sBBQ")  # magic, version, kind, seq
ALIVE_MIN_BYTES = _HEAD.size + 1 + 1 + TAG_BYTES
MAX_DATAGRAM_BYTES = _HEAD.size + 1 + MAX_NODE_BYTES + TAG_BYTES
ACK_BYTES = _HEAD.size + TAG_BYTES
#: a heartbeat's node name (``opsd.protocol.heartbeat.Name``)
_NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]*")
#: why a datagram is refused here (``LivenessError.reason``); the controller adds ``replay`` and ``skew``
REASONS = ("malformed", "version", "mac")


class LivenessError(PermanentError, ValueError):
    """A datagram that is not a liveness datagram of this version signed with a key the receiver holds; ``reason``
    is one of ``REASONS``, fit for a metric label."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def liveness_key(token: str) -> bytes:
    """The datagrams' key of a bearer token: HMAC-SHA256 of a fixed label, keyed with the token (the token itself
    never keys anything but the label, so a tag tells nothing of it)."""
    return hmac.digest(token.encode(), b"opsd liveness datagram v1", "sha256")


class Signer:
    """HMAC-SHA256 with one key, its inner and outer hashes started once: a tag costs two hash copies and two short
    updates (``hmac.digest`` looks the hash up in OpenSSL at every call, several times slower)."""

    __slots__ = ("_inner", "_outer")

    def __init__(self, key: bytes) -> None:
        block = key.ljust(64, b"\0") if len(key) <= 64 else hashlib.sha256(key).digest().ljust(64, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in block))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in block))

    def tag(self, data: bytes) -> bytes:
        inner = self._inner.copy()
        inner.update(data)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()[:TAG_BYTES]


def encode_alive(node: str, seq: int, signer: Signer) -> bytes:
    """A node's liveness datagram, signed."""
    name = node.encode()
    if not 0 < len(name) <= MAX_NODE_BYTES:
        raise ValueError(f"a node name is 1 to {MAX_NODE_BYTES} bytes")
    body = _HEAD.pack(MAGIC, VERSION, ALIVE, seq) + bytes((len(name),)) + name
    return body + signer.tag(body)


def decode_alive(data: bytes, signers: Sequence[Signer]) -> tuple[str, int, bytes]:
    """(node, seq, tag) of a liveness datagram signed by one of ``signers``; ``LivenessError`` otherwise."""
    size = len(data)
    if not ALIVE_MIN_BYTES <= size <= MAX_DATAGRAM_BYTES:
        raise LivenessError(
            f"{size} bytes: a liveness datagram is {ALIVE_MIN_BYTES} to {MAX_DATAGRAM_BYTES}", "malformed"
        )
    magic, version, kind, seq = _HEAD.unpack_from(data)
    if magic != MAGIC or kind != ALIVE:
        raise LivenessError("not a liveness datagram", "malformed")
    if version != VERSION:
        raise LivenessError(f"version {version}: this receiver takes version {VERSION}", "version")
    length = data[_HEAD.size]
    if size != _HEAD.size + 1 + length + TAG_BYTES:
        raise LivenessError(f"the node name's length ({length}) does not fit the datagram's size", "malformed")
    body, tag = data[:-TAG_BYTES], data[-TAG_BYTES:]
    if not any(hmac.compare_digest(s.tag(body), tag) for s in signers):
        raise LivenessError("the tag is not that of a key this receiver holds", "mac")
    try:
        node = body[_HEAD.size + 1 :].decode()
    except UnicodeDecodeError:
        raise LivenessError("the node name is not UTF-8", "malformed") from None
    if _NODE.fullmatch(node) is None:
        raise LivenessError(f"node name {node!r}: letters, digits and ._:/- only", "malformed")
    return node, seq, tag


def encode_ack(seq: int, tag: bytes) -> bytes:
    """The acknowledgement of the liveness datagram ``(seq, tag)``."""
    return _HEAD.pack(MAGIC, VERSION, ACK, seq) + tag


def decode_ack(data: bytes) -> tuple[int, bytes]:
    """(seq, tag) of an acknowledgement; ``LivenessError`` when it is not one of this version."""
    if len(data) != ACK_BYTES:
        raise LivenessError(f"{len(data)} bytes: an acknowledgement is {ACK_BYTES}", "malformed")
    magic, version, kind, seq = _HEAD.unpack_from(data)
    if magic != MAGIC or kind != ACK:
        raise LivenessError("not an acknowledgement", "malformed")
    if version != VERSION:
        raise LivenessError(f"version {version}: this receiver takes version {VERSION}", "version")
    return seq, data[_HEAD.size :]
