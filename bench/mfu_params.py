"""Matmul parameters counted by tracing against ``nn.Linear`` weights alone, and the FLOPs formula of each against
FlopCounterMode: ``python -m bench.mfu_params``.

For models built from torch's own layers (``nn.TransformerEncoderLayer``, ``nn.TransformerDecoderLayer``,
``nn.Transformer``), a language model whose output projection is its embedding (``F.linear`` on the embedding's
weight), a block written with ``F.linear`` and ``torch.matmul`` on bare ``nn.Parameter``\\ s, and the reference
model (dense and MoE), prints a Markdown table: the active matmul parameters counted from ``nn.Linear`` weights
and by ``shape_from_module`` (traced on the meta device), the FLOPs/token of ``flops_per_token`` with each count,
the FLOPs/token that ``measure_flops_per_token`` counts on one forward + backward, and the ratios. The table of
``docs/mfu.md`` is this output. Last line: ``mfu_params_max_rel_err=<largest relative difference of the traced
formula from FlopCounterMode>``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from examples.config import ModelConfig
from examples.model import Transformer, model_shape
from examples.parallelize import lm_loss
from trainer_hooks.flops import (
    ModelShape,
    attention_flops_per_token,
    flops_per_token,
    measure_flops_per_token,
    shape_from_module,
)
from trainer_hooks.matmul_params import is_routed_expert_param

DIM, N_HEADS, HIDDEN, SEQ_LEN, BATCH, VOCAB = 64, 4, 128, 64, 2, 256
HEAD_DIM = DIM // N_HEADS
REFERENCE = {"dim": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 96, "seq_len": 128, "n_layers": 2}


class FunctionalBlock(nn.Module):
    """Pre-norm causal attention and a GELU MLP on bare parameters: ``F.linear`` for the attention projections,
    ``torch.matmul`` for the MLP."""

    def __init__(self, dim: int, n_heads: int, hidden: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Parameter(torch.randn(3 * dim, dim) * dim**-0.5)
        self.proj = nn.Parameter(torch.randn(dim, dim) * dim**-0.5)
        self.up = nn.Parameter(torch.randn(dim, hidden) * dim**-0.5)
        self.down = nn.Parameter(torch.randn(hidden, dim) * hidden**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = F.linear(self.norm(x), self.qkv).view(b, s, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + F.linear(attention, self.proj)
        return x + torch.matmul(F.gelu(torch.matmul(x, self.up)), self.down)


class SelfAttention(nn.Module):
    """``nn.MultiheadAttention`` called as such: it returns the attention weights too, so it runs its own ``bmm``
    rather than fused attention."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(dim, n_heads, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _weights = self.attention(x, x, x)
        return out


class TiedLM(nn.Module):
    """Token embedding, torch's encoder layers under a causal mask, and the embedding as output projection."""

    def __init__(self, vocab: int, dim: int, n_heads: int, hidden: int, n_layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, n_heads, hidden, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        h = self.encoder(self.embed(tokens), mask=mask, is_causal=True)
        return F.linear(self.norm(h), self.embed.weight)


Inputs = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Case:
    """A model, one batch of its inputs, and its ``ModelShape``.

    ``attention_blocks`` is the ``n_layers`` of the formula: attention blocks a token goes through (a decoder
    layer has two, self and cross attention, over sequences of the same length here). Token models train on the
    next token (``lm_loss``); the others on the mean square of their output, with inputs that require grad so
    that the first matmuls' input gradients are computed as inside a model.
    """

    key: str
    name: str
    build: Callable[[], nn.Module]
    attention_blocks: int = 1
    n_inputs: int = 1
    tokens: bool = False
    reference: ModelConfig | None = None

    def batch(self) -> tuple[Inputs, torch.Tensor]:
        """(inputs, targets) of one batch; only the targets' count matters for the float models."""
        if self.tokens:
            vocab = self.reference.vocab_size if self.reference else VOCAB
            seq_len = self.reference.seq_len if self.reference else SEQ_LEN
            tokens = torch.randint(0, vocab, (BATCH, seq_len + 1))
            return (tokens[:, :-1],), tokens[:, 1:]
        inputs = tuple(torch.randn(BATCH, SEQ_LEN, DIM, requires_grad=True) for _ in range(self.n_inputs))
        return inputs, torch.zeros(BATCH, SEQ_LEN)

    def shape(self, model: nn.Module, inputs: Inputs) -> ModelShape:
        """``model_shape`` for the reference model; else ``shape_from_module``, with the batch as example inputs
        unless the model takes token ids (it then builds them)."""
        if isinstance(model, Transformer):
            return model_shape(model)
        return shape_from_module(
            model,
            n_layers=self.attention_blocks,
            n_heads=N_HEADS,
            head_dim=HEAD_DIM,
            seq_len=SEQ_LEN,
            example_inputs=None if self.tokens else inputs,
        )

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(outputs, targets) if self.tokens else outputs.float().square().mean()


def _reference(key: str, name: str, cfg: ModelConfig) -> Case:
    return Case(key, name, lambda: Transformer(cfg), cfg.n_layers, tokens=True, reference=cfg)


def _encoder_layer(dropout: float) -> nn.Module:
    return nn.TransformerEncoderLayer(DIM, N_HEADS, HIDDEN, dropout=dropout, batch_first=True)


CASES: tuple[Case, ...] = (
    Case("encoder_layer", "nn.TransformerEncoderLayer", lambda: _encoder_layer(0.0)),
    Case("encoder_layer_dropout", "nn.TransformerEncoderLayer, dropout 0.1", lambda: _encoder_layer(0.1)),
    Case("multihead_attention", "nn.MultiheadAttention, need_weights", lambda: SelfAttention(DIM, N_HEADS)),
    Case(
        "decoder_layer",
        "nn.TransformerDecoderLayer",
        lambda: nn.TransformerDecoderLayer(DIM, N_HEADS, HIDDEN, dropout=0.0, batch_first=True),
        attention_blocks=2,
        n_inputs=2,
    ),
    Case(
        "transformer",
        "nn.Transformer, 2+2 layers",
        lambda: nn.Transformer(DIM, N_HEADS, 2, 2, HIDDEN, dropout=0.0, batch_first=True),
        attention_blocks=2 + 2 * 2,
        n_inputs=2,
    ),
    Case(
        "tied_lm",
        "tied embeddings, 2 encoder layers",
        lambda: TiedLM(VOCAB, DIM, N_HEADS, HIDDEN, 2),
        attention_blocks=2,
        tokens=True,
    ),
    Case("functional", "F.linear / torch.matmul on nn.Parameter", lambda: FunctionalBlock(DIM, N_HEADS, HIDDEN)),
    _reference("reference_dense", "reference model, dense", ModelConfig(**REFERENCE)),
    _reference(
        "reference_moe",
        "reference model, MoE 8 experts top-2, 1 shared",
        ModelConfig(**REFERENCE, n_experts=8, n_shared_experts=1),
    ),
)


def linear_weight_params(module: nn.Module) -> int:
    """Dense matmul parameters counted from ``nn.Linear`` weights alone (routed experts excluded)."""
    names = {id(param): name for name, param in module.named_parameters()}
    weights = {id(sub.weight): sub.weight for sub in module.modules() if isinstance(sub, nn.Linear)}
    return sum(w.numel() for i, w in weights.items() if not is_routed_expert_param(names[i]))


@dataclass(frozen=True)
class Row:
    """One model: active matmul parameters and FLOPs/token counted from ``nn.Linear`` weights and traced."""

    name: str
    linear_params: int
    traced_params: int
    linear_flops: float
    traced_flops: float
    measured_flops: float

    @property
    def linear_ratio(self) -> float:
        return self.linear_flops / self.measured_flops

    @property
    def traced_ratio(self) -> float:
        return self.traced_flops / self.measured_flops


def measure(case: Case) -> tuple[nn.Module, ModelShape, Row]:
    """Build the model (seeded), count and measure it."""
    torch.manual_seed(0)
    model = case.build()
    inputs, targets = case.batch()
    shape = case.shape(model, inputs)
    # Not a ModelShape: it may have no dense matmul parameter at all (ModelShape refuses that).
    linear_params = linear_weight_params(model) + shape.active_matmul_params - shape.dense_matmul_params
    measured = measure_flops_per_token(model, inputs, targets, case.loss)
    row = Row(
        case.name,
        linear_params=linear_params,
        traced_params=shape.active_matmul_params,
        linear_flops=6.0 * linear_params + attention_flops_per_token(shape),
        traced_flops=flops_per_token(shape),
        measured_flops=measured,
    )
    return model, shape, row


HEADER = (
    "| model | matmul params, nn.Linear weights | matmul params, traced | FLOPs/token, nn.Linear weights "
    "| FLOPs/token, traced | FLOPs/token, FlopCounterMode | nn.Linear / measured | traced / measured |\n"
    "|---|--:|--:|--:|--:|--:|--:|--:|"
)


def render_table(rows: list[Row]) -> str:
    lines = [HEADER]
    for r in rows:
        lines.append(
            f"| {r.name} | {r.linear_params:,} | {r.traced_params:,} | {r.linear_flops:,.0f} | {r.traced_flops:,.0f} "
            f"| {r.measured_flops:,.0f} | {r.linear_ratio:.3f} | {r.traced_ratio:.3f} |"
        )
    return "\n".join(lines)


def rows() -> list[Row]:
    return [measure(case)[2] for case in CASES]


def main() -> None:
    torch.set_num_threads(1)
    start = time.perf_counter()
    table = rows()
    print(render_table(table))
    print(f"({time.perf_counter() - start:.2f} s)")
    worst = max(abs(r.traced_ratio - 1) for r in table)
    print(f"mfu_params_max_rel_err={worst:.6g}")


if __name__ == "__main__":
    main()
