"""The field types the wire's structs share (``opsd.protocol.wire``: a rank to its agent; ``opsd.protocol.heartbeat``:
an agent to the controller). Constraints (``Meta``) are checked on decoding only: a sender builds the structs without
them, the receiver refuses what breaks them."""

from __future__ import annotations

import sys
from typing import Annotated

from msgspec import Meta

Count = Annotated[int, Meta(ge=0)]
NonNegative = Annotated[float, Meta(ge=0)]  # JSON has no NaN or infinity; a number out of range is refused
Seconds = NonNegative
# the API's answers are converted from decoded JSON or from Python objects: NaN and the infinities refused there too
_MAX = sys.float_info.max
FINITE_BOUNDS = (f"`float` >= {-_MAX!r}", f"`float` <= {_MAX!r}")  # in msgspec's messages: "finite" in words
Finite = Annotated[float, Meta(ge=-_MAX, le=_MAX)]
FiniteSeconds = Annotated[float, Meta(ge=0, le=_MAX)]
# ``$`` alone would let a trailing newline through (Python's re.search)
Name = Annotated[str, Meta(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$(?!\n)")]
RankId = Annotated[int, Meta(ge=0, le=10_000_000)]
Label = Annotated[str, Meta(min_length=1, max_length=64)]
# W3C trace context ids in lower-case hex ("": none)
TraceId = Annotated[str, Meta(pattern=r"^([0-9a-f]{32})?$(?!\n)")]
SpanId = Annotated[str, Meta(pattern=r"^([0-9a-f]{16})?$(?!\n)")]
#: a JSON value kept as it was decoded, typed no further where it is kept (an action's arguments and result: their
#: structs are ``opsd.protocol.steps``'); read it with ``isinstance``, or decode it with its struct
JsonValue = Annotated[object, Meta(extra_json_schema={"description": "a JSON value"})]
JsonObject = dict[str, JsonValue]
