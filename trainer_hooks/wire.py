"""The step report a rank sends to its node agent: version 1 of the wire format (see docs/protocol.md).

One JSON object per step and rank, UTF-8, at most ``MAX_MESSAGE_BYTES``; never one message per collective.
"""

from __future__ import annotations

import json
import math
from typing import Any

VERSION = 1
MAX_MESSAGE_BYTES = 8192

#: field -> accepted types; every field is required.
STEP_FIELDS: dict[str, tuple[type, ...]] = {
    "v": (int,),
    "kind": (str,),
    "run": (str,),
    "rank": (int,),
    "world_size": (int,),
    "host": (str,),
    "step": (int,),
    "time_unix_s": (int, float),
    "step_s": (int, float),
    "compute_s": (int, float),
    "exposed_comm_s": (int, float),
    "overlapped_comm_s": (int, float),
    "tokens": (int,),
    "tokens_per_s": (int, float),
    "job_tokens_per_s": (int, float),
    "mfu_ratio": (int, float),
    "memory": (dict,),
    "coords": (dict,),
    "comms": (list,),
    "dropped_reports_total": (int,),
    "internal_errors_total": (int,),
}


class WireError(ValueError):
    """A message that does not follow the wire format; the text says which rule it breaks."""


def encode(message: dict[str, Any]) -> bytes:
    """Serialise a step report; drops the comms detail (flagging ``truncated``) rather than exceed the bound."""
    data = json.dumps(message, separators=(",", ":"), allow_nan=False).encode()
    if len(data) > MAX_MESSAGE_BYTES:
        data = json.dumps({**message, "comms": [], "truncated": True}, separators=(",", ":")).encode()
    return data


def decode(data: bytes) -> dict[str, Any]:
    """Parse and validate one datagram; raises :class:`WireError`."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        message = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise WireError("message is not a JSON object")
    if message.get("v") != VERSION:
        raise WireError(f"unsupported version {message.get('v')!r} (this side speaks {VERSION})")
    for name, types in STEP_FIELDS.items():
        if name not in message:
            raise WireError(f"missing field {name!r}")
        value = message[name]
        if isinstance(value, bool) or not isinstance(value, types):
            raise WireError(f"field {name!r} has type {type(value).__name__}")
        if isinstance(value, float) and not math.isfinite(value):
            raise WireError(f"field {name!r} is not finite")
    if message["kind"] != "step":
        raise WireError(f"unknown kind {message['kind']!r}")
    for entry in message["comms"]:
        if not (isinstance(entry, list) and len(entry) == 5):
            raise WireError("comms entries are [dimension, op, count, bytes, seconds]")
    return dict(message)
