"""Mixture-of-experts feed-forward: top-k routing, a sequence-wise load-balancing loss, expert parallelism.

Routing: softmax over the experts, the top-k kept and renormalised. No token is dropped unless a capacity factor is
set (``capacity = ceil(factor x tokens x k / experts)`` per expert, first come first served in token order).

Load balancing (Switch Transformer, Fedus et al. 2021, computed per sequence as in DeepSeek-V3): for each sequence
``aux = E x sum_e f_e x P_e`` with ``f_e`` the fraction of its top-k assignments that go to expert ``e`` and ``P_e``
its mean router probability, averaged over sequences. Being a mean over sequences, it is the same whichever way
the batch is split across data-parallel ranks or micro-batches; under context parallelism the per-sequence sums
are all-reduced over the cp group. Its gradient is injected in the backward pass (``coef x d aux``), so pipeline
stages need not carry it to the loss.

Expert parallelism: with ``ep_group`` set, this rank holds experts ``[r x E/ep, (r+1) x E/ep)``. Tokens sorted by
expert are sent to the expert's rank with ``all_to_all_single`` (differentiable), computed, and sent back.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol

from examples.config import ModelConfig
from examples.feed_forward import FeedForward


class _InjectAuxGrad(torch.autograd.Function):
    """Identity on ``out`` whose backward also gives ``aux`` the gradient 1 (so ``aux`` acts as a loss term)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape = aux.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones(ctx.aux_shape, dtype=grad.dtype, device=grad.device)


class GroupedExperts(nn.Module):
    """The SwiGLU experts held by this rank, as stacked weights ``[experts, ...]``."""

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))

    @property
    def n_local(self) -> int:
        return self.w1.shape[0]

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``x`` holds the tokens of expert 0, then expert 1, ...; ``counts`` says how many each."""
        outputs = []
        # Every expert runs, even on no token, so that every weight has a gradient on every rank.
        for e, chunk in enumerate(torch.split(x, counts)):
            hidden = F.silu(chunk @ self.w1[e].t()) * (chunk @ self.w3[e].t())
            outputs.append(hidden @ self.w2[e].t())
        return torch.cat(outputs)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_experts = cfg.n_experts
        self.top_k = cfg.top_k
        self.capacity_factor = cfg.capacity_factor
        self.aux_loss_coef = cfg.aux_loss_coef
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_experts, cfg.dim, cfg.ffn_hidden)
        self.shared: nn.Module | None = None
        if cfg.n_shared_experts:
            self.shared = FeedForward(cfg.dim, cfg.ffn_hidden * cfg.n_shared_experts)
        self.ep_group: dist.ProcessGroup | None = None
        self.cp_group: dist.ProcessGroup | None = None
        self.last_aux_loss: torch.Tensor | None = None
        self.dropped_tokens = 0

    def shard_experts(self, ep_group: dist.ProcessGroup) -> None:
        """Keep only this rank's slice of the experts (call on the full, identically initialised model)."""
        ep, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
        per_rank = self.n_experts // ep
        keep = slice(rank * per_rank, (rank + 1) * per_rank)
        for name in ("w1", "w2", "w3"):
            full = getattr(self.experts, name)
            setattr(self.experts, name, nn.Parameter(full.detach()[keep].clone()))
        self.ep_group = ep_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        tokens = x.reshape(-1, d)
        probs = self.router(tokens).float().softmax(dim=-1)
        top_w, top_e = probs.topk(self.top_k, dim=-1)
        top_w = (top_w / top_w.sum(dim=-1, keepdim=True)).to(x.dtype)

        flat_e = top_e.reshape(-1)
        order = torch.argsort(flat_e, stable=True)
        sorted_e = flat_e[order]
        sorted_t = torch.div(order, self.top_k, rounding_mode="floor")
        sorted_w = top_w.reshape(-1)[order]
        counts = torch.bincount(sorted_e, minlength=self.n_experts)
        if self.capacity_factor > 0:
            sorted_e, sorted_t, sorted_w, counts = self._drop_over_capacity(sorted_e, sorted_t, sorted_w, counts)

        y = self._run_experts(tokens[sorted_t], counts)
        out = torch.zeros_like(tokens).index_add(0, sorted_t, y * sorted_w[:, None]).view(b, s, d)
        if self.shared is not None:
            out = out + self.shared(x)
        if self.training and self.aux_loss_coef > 0:
            aux = self._balance_loss(probs.view(b, s, -1), top_e.view(b, s, -1))
            self.last_aux_loss = aux.detach()
            out = _InjectAuxGrad.apply(out, self.aux_loss_coef * aux)
        return out

    def _drop_over_capacity(
        self, sorted_e: torch.Tensor, sorted_t: torch.Tensor, sorted_w: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        capacity = math.ceil(self.capacity_factor * sorted_t.numel() / self.n_experts)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(sorted_e.numel(), device=sorted_e.device) - starts[sorted_e]
        keep = slot < capacity
        self.dropped_tokens = int((~keep).sum())
        return sorted_e[keep], sorted_t[keep], sorted_w[keep], counts.clamp(max=capacity)

    def _run_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.ep_group is None:
            return self.experts(x, counts.tolist())
        group = self.ep_group
        ep, n_local = dist.get_world_size(group), self.experts.n_local
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=group)
        in_splits = counts.view(ep, n_local).sum(dim=1).tolist()
        out_splits = recv_counts.view(ep, n_local).sum(dim=1).tolist()
        received = funcol.all_to_all_single_autograd(x, out_splits, in_splits, group)
        # Received rows come by source rank, then by local expert; regroup them by local expert.
        local_e = torch.arange(n_local, device=x.device).repeat(ep).repeat_interleave(recv_counts)
        perm = torch.argsort(local_e, stable=True)
        y = self.experts(received[perm], torch.bincount(local_e, minlength=n_local).tolist())
        y = y[torch.argsort(perm)]
        return funcol.all_to_all_single_autograd(y, in_splits, out_splits, group)

    def _balance_loss(self, probs: torch.Tensor, top_e: torch.Tensor) -> torch.Tensor:
        """Sequence-wise load-balancing loss of ``probs [b, s, E]`` and choices ``top_e [b, s, k]``."""
        n_experts = self.n_experts
        assigned = F.one_hot(top_e, n_experts).sum(dim=(1, 2)).to(probs.dtype)  # [b, E]
        prob_sum = probs.sum(dim=1)  # [b, E]
        seq_len = probs.shape[1]
        if self.cp_group is not None:
            dist.all_reduce(assigned, group=self.cp_group)
            prob_sum = dist_nn.all_reduce(prob_sum, group=self.cp_group)
            seq_len *= dist.get_world_size(self.cp_group)
        f = assigned / (seq_len * self.top_k)
        p = prob_sum / seq_len
        return n_experts * (f * p).sum(dim=-1).mean()
