"""How close the MFU FLOPs formula is to FLOPs counted on the reference model: ``python -m bench.mfu_accuracy``.

For dense and MoE configurations of ``examples.model``, counts one forward + backward with
``torch.utils.flop_counter`` (``trainer_hooks.flops.measure_flops_per_token``) and compares it with
``trainer_hooks.flops.flops_per_token``. Last line: ``mfu_flops_max_rel_err=<largest relative difference>``.
"""

from __future__ import annotations

import time

import torch

from examples.config import ModelConfig
from examples.model import Transformer, model_shape
from examples.parallelize import lm_loss
from trainer_hooks.flops import attention_flops_per_token, flops_per_token, measure_flops_per_token

CONFIGS: dict[str, ModelConfig] = {
    "dense_s128": ModelConfig(dim=64, n_heads=4, n_kv_heads=2, ffn_hidden=128, n_layers=2, seq_len=128),
    "dense_s512_mha": ModelConfig(dim=128, n_heads=8, n_kv_heads=8, ffn_hidden=256, n_layers=2, seq_len=512),
    "dense_wide_s64": ModelConfig(
        vocab_size=1024, dim=256, n_heads=4, n_kv_heads=1, ffn_hidden=512, n_layers=2, seq_len=64
    ),
    "moe_e4_k2": ModelConfig(dim=64, n_heads=4, n_kv_heads=2, ffn_hidden=96, n_layers=2, seq_len=128, n_experts=4),
    "moe_e8_k2_shared1": ModelConfig(
        dim=64, n_heads=4, n_kv_heads=2, ffn_hidden=96, n_layers=2, seq_len=256, n_experts=8, n_shared_experts=1
    ),
    "moe_e8_k1_s512": ModelConfig(
        dim=128, n_heads=4, n_kv_heads=2, ffn_hidden=128, n_layers=3, seq_len=512, n_experts=8, top_k=1
    ),
}


def compare(cfg: ModelConfig, batch_size: int = 2) -> tuple[float, float, float, float]:
    """(formula, measured, measured counting the attention recompute, attention share of the formula); FLOPs/token."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    shape = model_shape(model)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    measured = measure_flops_per_token(model, inputs, targets, lm_loss)
    hardware = measure_flops_per_token(model, inputs, targets, lm_loss, count_attention_recompute=True)
    formula = flops_per_token(shape)
    return formula, measured, hardware, attention_flops_per_token(shape) / formula


def main() -> None:
    torch.set_num_threads(1)
    worst = 0.0
    for name, cfg in CONFIGS.items():
        start = time.perf_counter()
        formula, measured, with_recompute, attention_share = compare(cfg)
        rel_err = abs(measured - formula) / formula
        worst = max(worst, rel_err)
        print(
            f"{name:<20} formula={formula:.6e} measured={measured:.6e} rel_err={rel_err:.2e} "
            f"with_attention_recompute={with_recompute / formula - 1:+.3f} "
            f"attention_share={attention_share:.2f} ({time.perf_counter() - start:.2f} s)"
        )
    print(f"mfu_flops_max_rel_err={worst:.6g}")


if __name__ == "__main__":
    main()
