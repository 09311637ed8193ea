"""Parallel layout of the reference trainer: parsing and validation of ``--mesh``.

This module is pure (no torch import): an impossible layout is rejected before the process group exists, so a
bad command line never reaches a collective.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

#: Mesh dimensions, outermost first. ``pp`` is outermost so that pipeline stages are far apart, ``tp`` innermost so
#: that tensor-parallel peers are neighbours (same node, fastest links). ``ep``, ``dp_shard`` and ``cp`` are
#: contiguous so that they flatten into the FSDP dimension, and ``dp_shard`` and ``cp`` flatten into the
#: data-parallel dimension of the experts.
DIM_NAMES: tuple[str, ...] = ("pp", "dp_replicate", "ep", "dp_shard", "cp", "tp")


class MeshError(ValueError):
    """A parallel layout that cannot run; the message names the violated constraint in one line."""


@dataclass(frozen=True)
class MeshSpec:
    """Degree of each parallel dimension; their product is the world size."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MeshError(f"mesh: {f.name} must be an integer >= 1, got {value!r}")

    @classmethod
    def parse(cls, text: str, world_size: int | None = None) -> MeshSpec:
        """Parse ``"dp_shard=2,tp=2"``; unnamed dimensions are 1. ``dp_shard=-1`` takes what the other degrees leave
        of ``world_size`` (so that a command line fits a job that grows or shrinks by whole data-parallel shards)."""
        degrees: dict[str, int] = {}
        for item in (part.strip() for part in text.split(",")):
            if not item:
                continue
            name, sep, raw = item.partition("=")
            name = name.strip()
            if not sep:
                raise MeshError(f"mesh: expected NAME=DEGREE, got {item!r}")
            if name not in DIM_NAMES:
                raise MeshError(f"mesh: unknown dimension {name!r}; known: {', '.join(DIM_NAMES)}")
            if name in degrees:
                raise MeshError(f"mesh: dimension {name!r} given twice")
            try:
                degrees[name] = int(raw)
            except ValueError:
                raise MeshError(f"mesh: degree of {name} must be an integer, got {raw.strip()!r}") from None
        if degrees.get("dp_shard") == -1:
            others = cls(**{**degrees, "dp_shard": 1}).world_size
            if world_size is None or world_size % others:
                raise MeshError(
                    f"mesh: dp_shard=-1 needs a world size that is a multiple of {others}, got {world_size}"
                )
            degrees["dp_shard"] = world_size // others
        return cls(**degrees)

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp * self.ep

    @property
    def batch_shards(self) -> int:
        """Ranks that see different sequences: every data-parallel rank, including the expert-parallel ones."""
        return self.dp_replicate * self.dp_shard * self.ep

    @property
    def fsdp_size(self) -> int:
        """Size of the flattened sharding dimension of the dense parameters (``ep`` x ``dp_shard`` x ``cp``)."""
        return self.ep * self.dp_shard * self.cp

    @property
    def data_parallel_size(self) -> int:
        """Ranks whose gradients are averaged for a dense parameter (every rank with different tokens)."""
        return self.dp_replicate * self.fsdp_size

    def degrees(self) -> dict[str, int]:
        """Every dimension with its degree, outermost first."""
        return {name: getattr(self, name) for name in DIM_NAMES}

    def __str__(self) -> str:
        named = [f"{name}={degree}" for name, degree in self.degrees().items() if degree > 1]
        return ",".join(named) or "single"


@dataclass(frozen=True)
class LayoutLimits:
    """What the model and the batch allow a layout to divide."""

    n_heads: int
    n_kv_heads: int
    n_layers: int
    n_experts: int
    seq_len: int
    batch_size: int
    microbatches: int


def validate_layout(spec: MeshSpec, world_size: int, limits: LayoutLimits) -> None:
    """Raise :class:`MeshError` naming the first constraint that ``spec`` breaks for this world and model."""
    if spec.world_size != world_size:
        raise MeshError(f"mesh: product of degrees {spec.world_size} ({spec}) must equal the world size {world_size}")
    if limits.n_heads % spec.tp:
        raise MeshError(f"mesh: tp={spec.tp} must divide the attention heads ({limits.n_heads})")
    if limits.n_kv_heads % spec.tp:
        raise MeshError(f"mesh: tp={spec.tp} must divide the key/value heads ({limits.n_kv_heads})")
    if spec.pp > limits.n_layers:
        raise MeshError(f"mesh: pp={spec.pp} must not exceed the layers ({limits.n_layers})")
    if spec.ep > 1 and limits.n_experts == 0:
        raise MeshError(f"mesh: ep={spec.ep} needs MoE layers (--experts)")
    if limits.n_experts and limits.n_experts % spec.ep:
        raise MeshError(f"mesh: ep={spec.ep} must divide the experts ({limits.n_experts})")
    if limits.seq_len % spec.cp:
        raise MeshError(f"mesh: cp={spec.cp} must divide the sequence length ({limits.seq_len})")
    if limits.batch_size % spec.batch_shards:
        raise MeshError(
            f"mesh: dp_replicate x dp_shard x ep = {spec.batch_shards} must divide the global batch "
            f"({limits.batch_size} sequences)"
        )
    local_batch = limits.batch_size // spec.batch_shards
    if spec.pp > 1 and local_batch % limits.microbatches:
        raise MeshError(
            f"mesh: microbatches={limits.microbatches} must divide the per-rank batch ({local_batch} sequences)"
        )
