"""The reference decoder and its MoE layer, single process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from examples.config import ModelConfig
from examples.model import Transformer
from examples.moe import MoE

MOE_CFG = ModelConfig(dim=16, n_heads=2, n_kv_heads=1, ffn_hidden=24, n_experts=4, top_k=2, seq_len=8)


def naive_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the weighted sum of its top-k experts (the definition, no dispatch)."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = moe.router(tokens).softmax(-1)
    weights, experts = probs.topk(moe.top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    rows = []
    for t in range(tokens.shape[0]):
        row = torch.zeros_like(tokens[t])
        for w, e in zip(weights[t], experts[t], strict=True):
            w1, w2, w3 = moe.experts.w1[e], moe.experts.w2[e], moe.experts.w3[e]
            row = row + w * (w2 @ (F.silu(w1 @ tokens[t]) * (w3 @ tokens[t])))
        rows.append(row)
    return torch.stack(rows).view_as(x)


def make_moe(cfg: ModelConfig = MOE_CFG) -> MoE:
    torch.manual_seed(0)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


def test_moe_dispatch_equals_the_definition() -> None:
    moe = make_moe().eval()
    x = torch.randn(3, 8, 16)
    torch.testing.assert_close(moe(x), naive_moe(moe, x), rtol=1e-5, atol=1e-6)
    assert moe.dropped_tokens == 0


def test_capacity_factor_drops_tokens_over_capacity() -> None:
    moe = make_moe(ModelConfig(**{**MOE_CFG.__dict__, "capacity_factor": 0.5})).eval()
    x = torch.randn(3, 8, 16)
    out = moe(x)
    # 24 tokens x 2 choices over 4 experts at factor 0.5: capacity 6 per expert, 24 of 48 assignments at most.
    assert moe.dropped_tokens >= 48 - 4 * 6
    assert not torch.allclose(out, naive_moe(moe, x))


def test_balance_loss_gradient_reaches_the_router_without_the_output() -> None:
    moe = make_moe().train()
    out = moe(torch.randn(2, 8, 16))
    (out * 0).sum().backward()
    assert moe.last_aux_loss is not None
    assert moe.last_aux_loss.item() >= 1.0 - 1e-6  # E x sum f_e P_e >= 1, equality when perfectly balanced
    assert moe.router.weight.grad is not None
    assert moe.router.weight.grad.abs().sum() > 0
    assert moe.experts.w1.grad is not None  # every expert weight has a gradient, if only zeros


def test_decoder_is_causal() -> None:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=32, dim=16, n_heads=2, n_kv_heads=1, ffn_hidden=24, seq_len=8))
    tokens = torch.randint(32, (1, 8))
    changed = tokens.clone()
    changed[0, 5] = (changed[0, 5] + 1) % 32
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :5], b[:, :5])
    assert not torch.allclose(a[:, 5:], b[:, 5:])


def test_same_seed_same_weights() -> None:
    cfg = ModelConfig(n_experts=4)
    torch.manual_seed(7)
    a = Transformer(cfg).state_dict()
    torch.manual_seed(7)
    b = Transformer(cfg).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dim": 30, "n_heads": 4}, "must divide model.dim"),
        ({"n_heads": 4, "n_kv_heads": 3}, "n_kv_heads=3 must divide"),
        ({"n_experts": 4, "top_k": 5}, "top_k=5"),
        ({"capacity_factor": -1.0}, "capacity_factor"),
    ],
    ids=["heads vs dim", "kv heads", "top-k", "capacity"],
)
def test_bad_model_config(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs)  # type: ignore[arg-type]
