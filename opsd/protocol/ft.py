"""Fault-tolerant replica groups (torchft): the names and settings a launcher, a backend and the trainer share.

A fault-tolerant job runs each ``dp_replicate`` replica group as a job of its own (its own torchrun world), and the
groups agree on a quorum at every step through one Lighthouse (docs/ft.md). What crosses the process boundary:

| variable | read by | what |
|---|---|---|
| ``TORCHFT_LIGHTHOUSE`` | rank 0 of each group (torchft's Manager) | the Lighthouse's address, ``http://host:port`` |
| ``REPLICA_GROUP_ID`` | every rank | this group's id, ``0 .. NUM_REPLICA_GROUPS - 1`` |
| ``NUM_REPLICA_GROUPS`` | every rank | the replica groups the job is laid out for (``dp_replicate``) |
| ``OPSD_FT_MIN_REPLICAS`` | every rank | the fewest groups a step commits with (the Lighthouse's ``--min_replicas``) |
| ``OPSD_FT_ADVERTISE_HOST`` | every rank | where other groups reach its Manager and state server (unset: host name) |
| ``TORCHFT_TIMEOUT_SEC`` | torchft's Manager | a collective, a commit vote, fetching a peer's state |
| ``TORCHFT_QUORUM_TIMEOUT_SEC`` | torchft's Manager | how long a group waits for a quorum before it gives up |
| ``TORCHFT_CONNECT_TIMEOUT_SEC`` | torchft's Manager | reaching the Lighthouse and the other groups' managers |
| ``TORCHFT_QUORUM_RETRIES`` | torchft's Manager | failed quorum requests tried again (a Lighthouse restarting) |

The launcher (a backend, ``examples.ft_launch``) sets them all. On Kubernetes a pod's bare host name does not resolve
in other pods: the JobSet gives ``OPSD_FT_ADVERTISE_HOST`` its pod's IP (docs/examples/jobset-ft.yaml).
The ``TORCHFT_*`` timeouts are torchft's own variables (its Manager reads them, and they win over its arguments),
which is why they are whole seconds. A rank that finds no quorum within the quorum timeout exits with
``EXIT_NO_QUORUM``: fewer groups than the minimum are alive, and only a restart of the whole job can go on.

Pure: no torch, no torchft; ``LighthouseConfig.argv`` is the Lighthouse's command line, ``ReplicaGroupEnv.env`` a
group's environment, ``ReplicaGroupEnv.from_env`` their validation on the trainer's side.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from opsd.protocol.mesh import MeshSpec

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
REPLICA_GROUP_ENV = "REPLICA_GROUP_ID"
REPLICA_GROUPS_ENV = "NUM_REPLICA_GROUPS"
MIN_REPLICAS_ENV = "OPSD_FT_MIN_REPLICAS"
#: "1": the group is relaunched while its peers train: it heals from a live peer and reads no checkpoint
HEAL_FROM_PEER_ENV = "OPSD_FT_HEAL_FROM_PEER"
ADVERTISE_HOST_ENV = "OPSD_FT_ADVERTISE_HOST"
TIMEOUT_ENV = "TORCHFT_TIMEOUT_SEC"
QUORUM_TIMEOUT_ENV = "TORCHFT_QUORUM_TIMEOUT_SEC"
CONNECT_TIMEOUT_ENV = "TORCHFT_CONNECT_TIMEOUT_SEC"
QUORUM_RETRIES_ENV = "TORCHFT_QUORUM_RETRIES"
#: the slowest read of a peer's state a healing group keeps up (its deadline: its state's size at this rate, or the
#: Manager's timeout if longer): a quarter of the 164 MB/s that ``bench.heal_transfer`` measured on loopback
HEAL_MIN_BYTES_PER_S = 40e6
#: a DNS name (RFC 1123 labels) or an IPv4 or IPv6 address, nothing else (no scheme, port or path)
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST = re.compile(rf"{_LABEL}(\.{_LABEL})*|[0-9A-Fa-f:.]+")

#: a rank's exit status when no quorum of ``min_replicas`` groups formed within the quorum timeout (sysexits'
#: EX_TEMPFAIL): the job cannot go on with the groups it has; the controller restarts it whole
EXIT_NO_QUORUM = 75
#: the Lighthouse's console script (in torchft's wheel) and its port when none is chosen
LIGHTHOUSE_COMMAND = "torchft_lighthouse"
LIGHTHOUSE_PORT = 29510


@dataclass(frozen=True)
class LighthouseConfig:
    """The Lighthouse's knobs (``torchft_lighthouse``'s options; docs/ft.md says what each bounds and the figures
    measured here).

    ``min_replicas``: the fewest replica groups a quorum may have. ``quorum_tick_ms``: how often the Lighthouse
    looks for a quorum while it waits. ``join_timeout_ms``: how long a valid quorum waits for groups that heartbeat
    but have not asked to join (a group starting up); the survivors of a failure wait this long at most for a
    restarted group. ``heartbeat_timeout_ms``: a group not heard from for this long is dead; the survivors' stall
    after a failure is about this long."""

    min_replicas: int = 1
    quorum_tick_ms: int = 100
    join_timeout_ms: int = 1000
    heartbeat_timeout_ms: int = 2000

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ValueError("lighthouse.min_replicas must be >= 1")
        for name in ("quorum_tick_ms", "join_timeout_ms", "heartbeat_timeout_ms"):
            if getattr(self, name) < 1:
                raise ValueError(f"lighthouse.{name} must be >= 1")
        if self.heartbeat_timeout_ms <= self.quorum_tick_ms:
            raise ValueError("lighthouse.heartbeat_timeout_ms must be > lighthouse.quorum_tick_ms")

    def argv(self, port: int = LIGHTHOUSE_PORT, host: str = "[::]", command: str = LIGHTHOUSE_COMMAND) -> list[str]:
        """The Lighthouse's command line, bound to ``host:port`` (0: a port of the OS's choice)."""
        if not 0 <= port < 65536:
            raise ValueError(f"lighthouse port {port} is not a TCP port")
        return [
            command,
            *("--bind", f"{host}:{port}"),
            *("--min_replicas", str(self.min_replicas)),
            *("--quorum_tick_ms", str(self.quorum_tick_ms)),
            *("--join_timeout_ms", str(self.join_timeout_ms)),
            *("--heartbeat_timeout_ms", str(self.heartbeat_timeout_ms)),
        ]


@dataclass(frozen=True)
class ManagerTimeouts:
    """torchft's Manager timeouts, whole seconds (torchft reads them from its variables as integers).

    ``timeout_s``: a cross-group collective, a commit vote, fetching a peer's state; it bounds a survivor's wait on
    a peer that hangs instead of dying. ``quorum_timeout_s``: how long a group waits for a quorum (the window for a
    restarted group to come back before fewer than ``min_replicas`` groups give up). ``connect_timeout_s``: reaching
    the Lighthouse and the other groups' managers. ``quorum_retries``: a failed quorum request (the Lighthouse
    down) is tried again this many times, spread over the quorum timeout: 60, about one a second at the default
    quorum timeout, so that the groups ride out a Lighthouse restart (torchft's default, 0, makes every group wait
    its quorum timeout and give up; docs/ft.md)."""

    timeout_s: int = 60
    quorum_timeout_s: int = 60
    connect_timeout_s: int = 10
    quorum_retries: int = 60

    def __post_init__(self) -> None:
        for name in ("timeout_s", "quorum_timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ft.{name} must be a whole number of seconds >= 1, got {value!r}")
        if self.quorum_retries < 0:
            raise ValueError("ft.quorum_retries must be >= 0")

    def env(self) -> dict[str, str]:
        return {
            TIMEOUT_ENV: str(self.timeout_s),
            QUORUM_TIMEOUT_ENV: str(self.quorum_timeout_s),
            CONNECT_TIMEOUT_ENV: str(self.connect_timeout_s),
            QUORUM_RETRIES_ENV: str(self.quorum_retries),
        }


@dataclass(frozen=True)
class ReplicaGroupEnv:
    """What a rank of a fault-tolerant job is told by its environment: its replica group, how many there are, where
    the Lighthouse is, the minimum quorum and torchft's timeouts, and whether it heals from a live peer
    (``heal_from_peer``: a group relaunched alone while the others train; it reads no checkpoint, even with
    ``--resume``, and takes no step of its own before it healed)."""

    group: int
    groups: int
    lighthouse: str
    min_replicas: int = 1
    timeouts: ManagerTimeouts = field(default_factory=ManagerTimeouts)
    heal_from_peer: bool = False
    advertise_host: str = ""  # the name or address other groups reach this rank at ("": the host's own name)

    def __post_init__(self) -> None:
        if self.groups < 1:
            raise ValueError(f"{REPLICA_GROUPS_ENV} must be >= 1, got {self.groups}")
        if not 0 <= self.group < self.groups:
            raise ValueError(f"{REPLICA_GROUP_ENV}={self.group} must be in [0, {REPLICA_GROUPS_ENV}={self.groups})")
        if not self.lighthouse.startswith(("http://", "https://")):
            raise ValueError(f"{LIGHTHOUSE_ENV} must be an http:// address, got {self.lighthouse!r}")
        if not 1 <= self.min_replicas <= self.groups:
            raise ValueError(f"{MIN_REPLICAS_ENV}={self.min_replicas} must be in [1, {self.groups}]")
        if self.advertise_host and not _HOST.fullmatch(self.advertise_host):
            raise ValueError(f"{ADVERTISE_HOST_ENV} must be a host name or an IP address, got {self.advertise_host!r}")

    def url_host(self, own_name: str) -> str:
        """The host part of a URL for this rank's servers: the advertised one, else ``own_name`` (an IPv6 address
        in brackets)."""
        host = self.advertise_host or own_name
        return f"[{host}]" if ":" in host else host

    def env(self) -> dict[str, str]:
        """The variables a launcher sets for every rank of this group (besides torchrun's own)."""
        return {
            LIGHTHOUSE_ENV: self.lighthouse,
            REPLICA_GROUP_ENV: str(self.group),
            REPLICA_GROUPS_ENV: str(self.groups),
            MIN_REPLICAS_ENV: str(self.min_replicas),
            HEAL_FROM_PEER_ENV: "1" if self.heal_from_peer else "0",
            **({ADVERTISE_HOST_ENV: self.advertise_host} if self.advertise_host else {}),
            **self.timeouts.env(),
        }

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> ReplicaGroupEnv:
        """Read and validate the variables; a missing or malformed one raises ``ValueError`` naming it."""

        def number(name: str, default: int | None = None) -> int:
            raw = environ.get(name, "").strip()
            if not raw:
                if default is None:
                    raise ValueError(f"{name} is not set (a fault-tolerant rank needs it)")
                return default
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"{name} must be an integer, got {raw!r}") from None

        def flag(name: str) -> bool:
            raw = environ.get(name, "").strip()
            if raw not in ("", "0", "1"):
                raise ValueError(f"{name} must be 0 or 1, got {raw!r}")
            return raw == "1"

        lighthouse = environ.get(LIGHTHOUSE_ENV, "").strip()
        if not lighthouse:
            raise ValueError(f"{LIGHTHOUSE_ENV} is not set (a fault-tolerant rank needs it)")
        defaults = ManagerTimeouts()
        timeouts = ManagerTimeouts(
            timeout_s=number(TIMEOUT_ENV, defaults.timeout_s),
            quorum_timeout_s=number(QUORUM_TIMEOUT_ENV, defaults.quorum_timeout_s),
            connect_timeout_s=number(CONNECT_TIMEOUT_ENV, defaults.connect_timeout_s),
            quorum_retries=number(QUORUM_RETRIES_ENV, defaults.quorum_retries),
        )
        return cls(
            group=number(REPLICA_GROUP_ENV),
            groups=number(REPLICA_GROUPS_ENV),
            lighthouse=lighthouse,
            min_replicas=number(MIN_REPLICAS_ENV, 1),
            timeouts=timeouts,
            heal_from_peer=flag(HEAL_FROM_PEER_ENV),
            advertise_host=environ.get(ADVERTISE_HOST_ENV, "").strip(),
        )


def group_layout(spec: MeshSpec, replica: ReplicaGroupEnv) -> MeshSpec:
    """The layout of one replica group of the job laid out as ``spec``: the same, without ``dp_replicate`` (each
    replica is a group, a world of its own). Raises ``ValueError`` when the groups do not match ``dp_replicate``."""
    if spec.dp_replicate != replica.groups:
        raise ValueError(
            f"--ft: the mesh's dp_replicate={spec.dp_replicate} must equal {REPLICA_GROUPS_ENV}={replica.groups}"
        )
    return replace(spec, dp_replicate=1)
