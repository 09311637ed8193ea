"""How a rank reaches its node's agent over the network, with no host directory shared (docs/protocol.md,
"Transport"): its step reports as UDP datagrams to the agent's datagram port, the controller's policy and its Flight
Recorder dumps over the agent's HTTP port, at the node's address, ``$OPSD_AGENT_HOST`` (on Kubernetes the pod's
``status.hostIP``, through the downward API; the agent listens there on host ports). And where a dump lands: a rank
with the host directory writes ``<run>/<trigger>/rank-<rank>.json`` there itself; one without sends it, and the
agent writes it to the same place in its own directory.

    address = agent_address(os.environ)     # None without $OPSD_AGENT_HOST
    address.datagrams                       # ("10.0.3.7", 9465)
    address.policy_url                      # "http://10.0.3.7:9464/v1/policy"
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Annotated

from msgspec import Meta, Struct

from opsd.protocol.env import AGENT_DATAGRAM_PORT_ENV, AGENT_HOST_ENV, AGENT_HTTP_PORT_ENV

DATAGRAM_PORT = 9465
HTTP_PORT = 9464
#: GET: the policy file's JSON (docs/protocol.md, "Policy"), ``{"v": 1}`` before the controller sent one
POLICY_PATH = "/v1/policy"
#: POST: one rank's Flight Recorder dump, as it would write it to its directory
FLIGHT_PATH = "/v1/flight-recorder"
MAX_DUMP_BYTES = 64 << 20
#: how many dumps an agent takes in at once; a further sender waits for a slot (``UPLOAD_WAIT_S`` at most, then 503
#: with ``Retry-After``)
UPLOAD_SLOTS = 2
UPLOAD_WAIT_S = 20.0

_UNSAFE = re.compile(r"[^A-Za-z0-9._:-]")


@dataclass(frozen=True)
class AgentAddress:
    host: str
    datagram_port: int = DATAGRAM_PORT
    http_port: int = HTTP_PORT

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("the agent's host must not be empty")
        for name, port in (("datagram", self.datagram_port), ("http", self.http_port)):
            if not 1 <= port <= 65535:
                raise ValueError(f"the agent's {name} port must be in 1-65535, not {port}")

    @property
    def datagrams(self) -> tuple[str, int]:
        return self.host, self.datagram_port

    @property
    def http_base(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address
        return f"http://{host}:{self.http_port}"

    @property
    def policy_url(self) -> str:
        return self.http_base + POLICY_PATH

    @property
    def flight_url(self) -> str:
        return self.http_base + FLIGHT_PATH


class DumpHeader(Struct):
    """What the agent reads of a dump sent to ``FLIGHT_PATH`` (the rest of the object is kept as sent): the run, the
    trigger and the rank name the file it lands in. Decoded with the dump's other fields skipped, not built."""

    run: Annotated[str, Meta(min_length=1)]
    trigger: Annotated[str, Meta(min_length=1)]
    rank: Annotated[int, Meta(ge=0)]


def _port(environ: Mapping[str, str], name: str, default: int) -> int:
    text = environ.get(name, "").strip()
    if not text:
        return default
    if not text.isdigit():
        raise ValueError(f"{name} must be a port number, not {text!r}")
    return int(text)


def agent_address(environ: Mapping[str, str]) -> AgentAddress | None:
    """The agent's address from ``$OPSD_AGENT_HOST`` and its ports' variables; None when the host is not set.
    ``ValueError`` naming the variable for a port that is not one."""
    host = environ.get(AGENT_HOST_ENV, "").strip()
    if not host:
        return None
    return AgentAddress(
        host, _port(environ, AGENT_DATAGRAM_PORT_ENV, DATAGRAM_PORT), _port(environ, AGENT_HTTP_PORT_ENV, HTTP_PORT)
    )


def path_part(name: str) -> str:
    """``name`` as one path component: characters other than letters, digits and ``._:-`` become ``_``."""
    safe = _UNSAFE.sub("_", name)[:200]
    return safe if safe.strip(".") else "_"


def dump_path(run: str, trigger: str, rank: int) -> PurePosixPath:
    """Where a rank's dump lies under a flight directory."""
    return PurePosixPath(path_part(run), path_part(trigger), f"rank-{rank}.json")
