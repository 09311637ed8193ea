"""The reference model's configuration: its sizes and its mixture of experts (pure: no torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 128
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 128
    seq_len: int = 32
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    n_experts: int = 0
    top_k: int = 2
    n_shared_experts: int = 0
    capacity_factor: float = 0.0
    aux_loss_coef: float = 0.01

    def __post_init__(self) -> None:
        if min(self.vocab_size, self.dim, self.n_layers, self.n_heads, self.n_kv_heads, self.ffn_hidden) < 1:
            raise ValueError("model: sizes must be >= 1")
        if self.dim % self.n_heads:
            raise ValueError(f"model.n_heads={self.n_heads} must divide model.dim={self.dim}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError("model: head dimension must be even for rotary positions")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.n_heads}")
        if self.n_experts < 0 or self.n_shared_experts < 0:
            raise ValueError("model.n_experts and model.n_shared_experts must be >= 0")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"model.top_k={self.top_k} must be in [1, n_experts={self.n_experts}]")
        if self.capacity_factor < 0:
            raise ValueError("model.capacity_factor must be >= 0 (0 = no token dropping)")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads
