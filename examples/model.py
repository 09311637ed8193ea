"""A small Llama-style decoder: RMSNorm, rotary positions, grouped-query causal attention, SwiGLU MLP, optional MoE.

The modules are written so that every parallelism of the reference trainer can be applied from outside:
attention infers its local head count from its projections (tensor parallel), the decoder's parts are optional
(pipeline stages keep only theirs), attention can gather keys and values over a context-parallel group, and the
MoE layer can dispatch tokens over an expert-parallel group (see ``examples.moe``).
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol

from examples.config import ModelConfig
from examples.feed_forward import FeedForward
from examples.moe import MoE
from trainer_hooks.flops import ModelShape, shape_from_module


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalised in float32 whatever the activations' dtype (the same operations in fp32 training)
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rotary_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine tables ``[seq_len, head_dim // 2]`` of rotary position embeddings (RoFormer)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of ``x [b, s, h, d]`` by the angles of its positions (``cos``/``sin`` are ``[s, d/2]``, float32);
    the result has ``x``'s dtype."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2).to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query attention.

    With a context-parallel group set (``cp_group``), each rank holds a contiguous chunk of the sequence: it
    all-gathers keys and values over the group (differentiable; the backward reduce-scatters their gradients) and
    masks by global positions. This is the all-gather variant used for Llama 3's long-context training.

    Keys and values travel in one all-gather, never two at once on the group: two collectives in flight on one
    gloo group can corrupt the process's heap (docs/crash.md), and one message instead of two is cheaper anyway.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.cp_group: dist.ProcessGroup | None = None

    def _gather_sequence(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """All-gather ``k`` and ``v`` ``[b, s_local, h, d]`` over the cp group into ``[b, s, h, d]`` each, in one
        collective (ranks hold chunks of the sequence in order)."""
        assert self.cp_group is not None
        both = torch.stack((k, v)).permute(2, 0, 1, 3, 4).contiguous()  # [s_local, 2, b, h, d]
        gathered = funcol.all_gather_single_autograd(both, gather_dim=0, group=self.cp_group)  # [s, 2, b, h, d]
        k, v = gathered.permute(1, 2, 0, 3, 4).unbind(0)
        return k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, offset: int) -> torch.Tensor:
        b, s, _ = x.shape
        # -1: under tensor parallelism each rank holds only its heads.
        q = apply_rotary(self.wq(x).view(b, s, -1, self.head_dim), cos, sin).transpose(1, 2)
        k = apply_rotary(self.wk(x).view(b, s, -1, self.head_dim), cos, sin)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.cp_group is None:
            mask = None
        else:
            k, v = self._gather_sequence(k, v)
            q_pos = torch.arange(offset, offset + s, device=x.device)
            mask = q_pos[:, None] >= torch.arange(k.shape[1], device=x.device)[None, :]
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        repeats = q.shape[1] // k.shape[1]
        if repeats > 1:
            k = k.repeat_interleave(repeats, dim=1)
            v = v.repeat_interleave(repeats, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward: nn.Module = MoE(cfg) if cfg.n_experts else FeedForward(cfg.dim, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, offset: int) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, offset)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The decoder. A pipeline stage is a copy with the parts of other stages set to ``None`` / removed.

    ``layers`` is a dict keyed by the global layer index, so parameter names are the same in every layout.
    ``seq_offset`` is the global position of this rank's first token (non-zero under context parallelism).
    """

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg.head_dim, cfg.seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.seq_offset = 0
        self._init_weights()

    def _init_weights(self) -> None:
        out_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                continue
            leaf = name.rsplit(".", 1)[0].rsplit(".", 1)[-1]
            std = out_std if leaf in ("wo", "w2") or name.endswith(".w2") else 0.02
            nn.init.normal_(param, mean=0.0, std=std)

    def blocks(self) -> list[TransformerBlock]:
        """This stage's transformer blocks, in order."""
        return [cast(TransformerBlock, block) for block in self.layers.values()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        s = h.shape[1]
        cos = self.rope_cos[self.seq_offset : self.seq_offset + s]
        sin = self.rope_sin[self.seq_offset : self.seq_offset + s]
        for block in self.blocks():
            h = block(h, cos, sin, self.seq_offset)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h


def model_shape(model: Transformer) -> ModelShape:
    """What the MFU formula needs to know of ``model`` (the whole model: build it on the meta device if needed).

    The matmul parameters are traced over one sequence of ``cfg.seq_len`` tokens on the meta device; the routing of
    the MoE layers cannot run there, so their router and shared experts count as ``nn.Linear`` weights and their
    routed experts by name (``docs/mfu.md``).
    """
    cfg = model.cfg
    return shape_from_module(
        model,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        head_dim=cfg.head_dim,
        seq_len=cfg.seq_len,
        n_experts=cfg.n_experts,
        top_k=cfg.top_k,
    )
