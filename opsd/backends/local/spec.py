"""What ``opsd run`` is asked to run: the trainer command, how many local "nodes" of how many ranks, the spares,
where the nodes' files go, and what to do when no spare is left."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from opsd.controller.rows import RunSpec
from opsd.policy.recovery import OnNoSpare
from opsd.policy.replicas import ReplicaGroups
from opsd.protocol.ft import LighthouseConfig, ManagerTimeouts
from opsd.protocol.states import ActionKind


class LocalNodes(msgspec.Struct, frozen=True):
    """The local backend's own part of a run's spec (``RunSpec.own``): a controller that takes the run up checks
    ``nodes`` and ``spares``."""

    nodes: int
    spares: int
    gpus_per_node: int


@dataclass(frozen=True)
class LocalRunSpec:
    run: str
    command: tuple[str, ...]
    nodes: int = 2
    gpus_per_node: int = 2
    spares: int = 1
    workdir: str = ".opsd/runs"
    controller_url: str = ""  # the agents' heartbeat endpoint
    token: str = ""
    checkpoint_url: str = ""  # where the trainer checkpoints: tells which step a launch resumes from
    heartbeat_interval_s: float = 0.5
    gpu_interval_s: float = 0.2
    extra_env: dict[str, str] = field(default_factory=dict)
    on_no_spare: OnNoSpare = OnNoSpare.WAIT  # or shrink: relaunch on the nodes left, down to min_nodes
    min_nodes: int = 1
    crash_after_action: str = ""  # fault injection (tests): SIGKILL this controller once an action of this kind is done
    replica_groups: int = 1  # fault-tolerant replica groups (torchft): the nodes split evenly, a world each
    min_replicas: int = 1  # the fewest groups that keep a quorum (the Lighthouse's --min_replicas)
    heartbeat_timeout_ms: int = LighthouseConfig().heartbeat_timeout_ms  # a group not heard from is dead after this
    ft_timeouts: ManagerTimeouts = field(default_factory=ManagerTimeouts)  # torchft's Manager timeouts

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("run: a trainer command is needed (after --)")
        if self.nodes < 1 or self.gpus_per_node < 1 or self.spares < 0:
            raise ValueError("run: --nodes and --gpus-per-node must be >= 1, --spares >= 0")
        try:
            object.__setattr__(self, "on_no_spare", OnNoSpare(self.on_no_spare))
        except ValueError:
            raise ValueError(f"run: --on-no-spare must be one of {', '.join(OnNoSpare)}") from None
        if not 1 <= self.min_nodes <= self.nodes:
            raise ValueError("run: --min-nodes must be between 1 and --nodes")
        if not self.run or "/" in self.run:
            raise ValueError("run: the run name must be non-empty, without '/'")
        if self.crash_after_action and self.crash_after_action not in tuple(ActionKind):
            raise ValueError(f"run: --crash-after-action must be one of {', '.join(ActionKind)}")
        try:
            self.replicas.group_of_node(0, self.nodes)
        except ValueError as exc:
            raise ValueError(f"run: --replica-groups: {exc}") from None
        if self.replica_groups > 1 and self.on_no_spare is not OnNoSpare.WAIT:
            raise ValueError("run: a fault-tolerant run goes on with the groups it has: --on-no-spare is for others")

    @property
    def replicas(self) -> ReplicaGroups:
        return ReplicaGroups(self.replica_groups, self.min_replicas)

    @property
    def lighthouse(self) -> LighthouseConfig:
        return LighthouseConfig(min_replicas=self.min_replicas, heartbeat_timeout_ms=self.heartbeat_timeout_ms)

    @property
    def root(self) -> Path:
        return Path(self.workdir) / self.run

    def node_dir(self, node: str) -> Path:
        return self.root / "nodes" / node

    def node_names(self) -> list[str]:
        """The run's nodes, then its spares: ``node-0`` ... ``node-{nodes + spares - 1}``."""
        return [f"node-{i}" for i in range(self.nodes + self.spares)]

    def recorded(self) -> RunSpec:
        """What the state store keeps of the run's spec (a controller that takes the run up checks it; the recovery
        reads ``checkpoint_url``, ``on_no_spare`` and ``min_nodes`` from it)."""
        return RunSpec(
            backend="local",
            checkpoint_url=self.checkpoint_url,
            on_no_spare=self.on_no_spare,
            min_nodes=self.min_nodes,
            replica_groups=self.replica_groups,
            min_replicas=self.min_replicas,
        ).with_own(LocalNodes(self.nodes, self.spares, self.gpus_per_node))
