"""The run's key: how an agent tells its run's ranks from a pod elsewhere that reaches its network endpoints (the UDP
step reports, ``GET /v1/policy``, ``POST /v1/flight-recorder``: docs/protocol.md, "The run's key").

An agent holds the ranks' secret (one for the cluster, in the chart's Secret); each run's key is derived from it and
the run's name, so that the key of one run says nothing of another's or of the secret::

    key = run_key(secret, "llm")                 # 64 hex digits: what the run's pods get as $OPSD_RANK_KEY
    datagram = sign(encode(report), key)         # b"opsd-sig1:<32 hex digits>\\n" + the report
    tag, body = split_signed(datagram)           # the agent: the tag, and the report as encoded
    verify(tag, body, run_key(secret, report.run))

Over HTTP a rank sends ``Authorization: Bearer <key>`` and ``X-Opsd-Run: <run>``. The Unix socket in the host
directory needs none: who may write there is the host's file permissions.

The agent's mode (``agent.rank_auth``): ``off`` (no secret: nothing checked), ``optional`` (a signed message with a
wrong tag is refused, an unsigned one is taken and counted: runs whose pods do not have their key yet keep
training) or ``required`` (an unsigned message is refused too).
"""

from __future__ import annotations

import hashlib
import hmac
from enum import StrEnum
from typing import Final

from opsd.protocol.wire import MAX_MESSAGE_BYTES, WireError

PREFIX: Final = b"opsd-sig1:"
TAG_HEX: Final = 32  # 128 bits of HMAC-SHA256
SIGNATURE_BYTES: Final = len(PREFIX) + TAG_HEX + 1
#: a signed datagram's bound: the report's, and its signature
MAX_DATAGRAM_BYTES: Final = MAX_MESSAGE_BYTES + SIGNATURE_BYTES
RUN_HEADER: Final = "X-Opsd-Run"
_DERIVATION: Final = b"opsd run key\x00"


class RankAuth(StrEnum):
    OFF = "off"
    OPTIONAL = "optional"
    REQUIRED = "required"


def run_key(secret: str, run: str) -> str:
    """The key of ``run``'s ranks, from the agents' secret: 64 hex digits."""
    if not secret:
        raise ValueError("the ranks' secret must not be empty")
    return hmac.new(secret.encode(), _DERIVATION + run.encode(), hashlib.sha256).hexdigest()


def _tag(body: bytes, key: str) -> bytes:
    return hmac.new(key.encode(), body, hashlib.sha256).hexdigest()[:TAG_HEX].encode()


def sign(body: bytes, key: str) -> bytes:
    """``body`` (an encoded report) signed with the run's ``key``."""
    return PREFIX + _tag(body, key) + b"\n" + body


def split_signed(data: bytes) -> tuple[bytes | None, bytes]:
    """A datagram's tag (None: unsigned) and its body. ``WireError`` (reason ``signature``) for a signature that is
    not one."""
    if not data.startswith(PREFIX):
        return None, data
    tag, newline = data[len(PREFIX) : len(PREFIX) + TAG_HEX], data[len(PREFIX) + TAG_HEX : SIGNATURE_BYTES]
    if newline != b"\n" or len(tag) != TAG_HEX:
        raise WireError("a signature is opsd-sig1: then 32 hex digits and a newline", "signature")
    return tag, data[SIGNATURE_BYTES:]


def verify(tag: bytes, body: bytes, key: str) -> bool:
    """Whether ``tag`` is ``body``'s under ``key`` (compared in constant time)."""
    return hmac.compare_digest(tag, _tag(body, key))


def key_ok(presented: str, run: str, secret: str) -> bool:
    """Whether ``presented`` (a bearer token) is ``run``'s key (compared in constant time)."""
    return bool(run) and hmac.compare_digest(presented.encode(), run_key(secret, run).encode())


def headers(run: str, key: str) -> dict[str, str]:
    """The HTTP headers of a rank's request to its agent."""
    return {"Authorization": f"Bearer {key}", RUN_HEADER: run}
