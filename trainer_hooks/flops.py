"""FLOPs accounting and model FLOPs utilisation (MFU) of a decoder-only transformer.

MFU (PaLM, Chowdhery et al. 2022, appendix B) is ``tokens/s x FLOPs/token / peak FLOP/s`` where FLOPs/token are
the *model* FLOPs of one training step (forward + backward), not counting activation recomputation:

    FLOPs/token = 6 x N_active + 12 x n_layers x n_heads x head_dim x seq_len

``N_active`` are the matmul parameters a token goes through (for a mixture of experts: every dense matmul, the
router and shared experts, and ``top_k`` routed experts). The attention term counts the full ``S x S`` score and
value matmuls (not halved for the causal mask): the convention of PaLM, Megatron-LM and torchtitan, so that MFU is
comparable across tools. A causal-aware attention kernel does about half of that attention work.

``shape_from_module`` counts the matmul parameters by tracing one forward on the meta device
(``trainer_hooks.matmul_params``): weights that enter matmuls outside ``nn.Linear`` count too
(``nn.MultiheadAttention``'s in-projection, ``F.linear`` on a bare parameter, a tied output projection; see
``docs/mfu.md``).

``measure_flops_per_token`` counts the FLOPs of one real forward + backward with ``torch.utils.flop_counter`` so
the formula can be checked against the model (see ``bench/mfu_accuracy.py`` and ``bench/mfu_params.py``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

from trainer_hooks.matmul_params import count_matmul_params, is_routed_expert_param

log = logging.getLogger(__name__)

aten = torch.ops.aten

# Dense BF16 tensor-core peak of one GPU (no sparsity), FLOP/s, from the vendors' data sheets.
PEAK_FLOPS_BF16: dict[str, float] = {
    "A100": 312e12,
    "H100": 989e12,
    "H200": 989e12,
    "B200": 2.25e15,
    "MI300X": 1.3e15,
}


@dataclass(frozen=True)
class ModelShape:
    """What FLOPs accounting needs to know of a decoder-only transformer.

    ``dense_matmul_params``: parameters of the matmuls every token goes through (attention projections, dense MLPs,
    MoE routers, shared experts, the output projection); not the embedding lookup, not norms.
    ``expert_matmul_params``: matmul parameters of *one* routed expert per MoE layer, summed over the MoE layers
    (all routed-expert matmul parameters divided by ``n_experts``); 0 for a dense model.
    ``n_experts``: routed experts per MoE layer, 0 for a dense model. ``top_k``: routed experts per token (unused
    when dense).
    """

    n_layers: int
    n_heads: int
    head_dim: int
    seq_len: int
    dense_matmul_params: int
    expert_matmul_params: int = 0
    n_experts: int = 0
    top_k: int = 0

    def __post_init__(self) -> None:
        for name in ("n_layers", "n_heads", "head_dim", "seq_len"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"model_shape.{name} must be an int >= 1, got {value!r}")
        for name in ("dense_matmul_params", "expert_matmul_params", "n_experts", "top_k"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ValueError(f"model_shape.{name} must be an int >= 0, got {value!r}")
        if self.n_experts == 0 and self.expert_matmul_params:
            raise ValueError("model_shape.expert_matmul_params must be 0 when n_experts is 0 (dense model)")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"model_shape.top_k must be in [1, n_experts={self.n_experts}], got {self.top_k}")
        if self.active_matmul_params == 0:
            raise ValueError("model_shape.dense_matmul_params must be > 0 (or the model must have experts)")

    @property
    def active_matmul_params(self) -> int:
        """Matmul parameters one token goes through: the dense ones and ``top_k`` routed experts."""
        routed = self.top_k * self.expert_matmul_params if self.n_experts else 0
        return self.dense_matmul_params + routed


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def example_token_inputs(module: nn.Module, seq_len: int) -> torch.Tensor | None:
    """One sequence of ``seq_len`` token ids on the meta device if ``module`` has an ``nn.Embedding`` (a language
    model taking token ids), else ``None``."""
    if any(isinstance(sub, nn.Embedding) for sub in module.modules()):
        return torch.zeros((1, seq_len), dtype=torch.long, device="meta")
    return None


def shape_from_module(
    module: nn.Module,
    *,
    n_layers: int,
    n_heads: int,
    head_dim: int,
    seq_len: int,
    n_experts: int = 0,
    top_k: int = 0,
    expert_param_filter: Callable[[str], bool] = is_routed_expert_param,
    example_inputs: torch.Tensor | tuple[Any, ...] | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
) -> ModelShape:
    """Count the matmul parameters of ``module`` into a ``ModelShape``.

    The dense matmul parameters are those that enter matmuls in one forward of ``module(*example_inputs,
    **example_kwargs)`` traced on the meta device (``trainer_hooks.matmul_params.count_matmul_params``): every
    weight of an ``nn.Linear``, ``F.linear`` or ``torch.matmul``, ``nn.MultiheadAttention``'s fused in-projection,
    an output projection tied to the embedding (once; the lookup itself is no matmul). Without ``example_inputs``,
    a model with an ``nn.Embedding`` gets one sequence of ``seq_len`` token ids; other models should pass their
    inputs (any device: only shapes and dtypes are used), or only ``nn.Linear`` and ``nn.MultiheadAttention``
    weights are counted. The trace never raises: what cannot run on the meta device is counted by that static rule
    (logged).

    Every parameter ``expert_param_filter(name)`` accepts is a routed-expert parameter: their sum is divided by
    ``n_experts``. A ``ValueError`` says that the declared ``n_experts`` does not fit the parameters.

    Call it on the full, unsharded model (e.g. before ``parallelize`` or on a meta-device copy): after pipeline
    splitting or expert sharding a rank holds only part of the parameters and the count would be too small. With
    an already-sharded model, build the ``ModelShape`` by hand.
    """
    if example_inputs is None and not example_kwargs:
        example_inputs = example_token_inputs(module, seq_len)
    elif example_inputs is None:
        example_inputs = ()
    counted = count_matmul_params(module, example_inputs, example_kwargs, expert_param_filter=expert_param_filter)
    dense = counted.dense_total
    experts = counted.experts_total
    if n_experts == 0:
        if experts:
            raise ValueError(f"{experts} routed-expert parameters found but n_experts=0; pass n_experts")
        expert_params = 0
    else:
        if experts == 0:
            raise ValueError(f"n_experts={n_experts} but no parameter matched expert_param_filter")
        if experts % n_experts:
            raise ValueError(
                f"routed-expert parameters ({experts}) are not divisible by n_experts={n_experts}: "
                "is the model sharded? Call shape_from_module on the unsharded model"
            )
        expert_params = experts // n_experts
    return ModelShape(
        n_layers=n_layers,
        n_heads=n_heads,
        head_dim=head_dim,
        seq_len=seq_len,
        dense_matmul_params=dense,
        expert_matmul_params=expert_params,
        n_experts=n_experts,
        top_k=top_k,
    )


def attention_flops_per_token(shape: ModelShape) -> float:
    """Training FLOPs of the attention scores and values per token: ``12 x n_layers x n_heads x head_dim x seq_len``.

    Forward: two matmuls (``Q K^T`` and ``P V``) of ``2 x seq_len x head_dim`` FLOPs per token and head; backward
    twice that. The causal mask is not taken into account (see the module docstring).
    """
    return 12.0 * shape.n_layers * shape.n_heads * shape.head_dim * shape.seq_len


def flops_per_token(shape: ModelShape) -> float:
    """Model FLOPs of one training step (forward + backward) per token.

    ``6 x active_matmul_params + 12 x n_layers x n_heads x head_dim x seq_len`` (PaLM, appendix B; the same
    convention as torchtitan). The forward pass is one third of it, the backward two thirds. Activation
    recomputation is not counted (it is model FLOPs, not hardware FLOPs).

    Causal mask: the attention term counts the full ``S x S`` score and value matmuls, *not* halved for the causal
    mask, the convention of PaLM, Megatron-LM and torchtitan, so that MFU is comparable across tools. A causal-aware
    kernel (flash attention) does about half of that attention work, so its real utilisation of the attention part
    is about half of what this reports.
    """
    return 6.0 * shape.active_matmul_params + attention_flops_per_token(shape)


# --- measuring -------------------------------------------------------------------------------------------------

# The CPU fused attention kernels have no formula in torch.utils.flop_counter (torch 2.13): without one, the
# attention FLOPs are silently missing from the count on CPU.
_CPU_SDPA_FORWARD = "_scaled_dot_product_flash_attention_for_cpu"
_CPU_SDPA_BACKWARD = "_scaled_dot_product_flash_attention_for_cpu_backward"

# Backward SDPA kernels whose torch formula counts the recomputation of the scores (flash-style kernels).
_SDPA_BACKWARD_OPS = (
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward",
    _CPU_SDPA_BACKWARD,
)


def _cpu_sdpa_flop(
    query_shape: torch.Size, key_shape: torch.Size, value_shape: torch.Size, *args: Any, **kwargs: Any
) -> int:
    """``aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal, ...)``."""
    return int(sdpa_flop_count(query_shape, key_shape, value_shape))


def _cpu_sdpa_backward_flop(
    grad_out_shape: torch.Size,
    query_shape: torch.Size,
    key_shape: torch.Size,
    value_shape: torch.Size,
    *args: Any,
    **kwargs: Any,
) -> int:
    """``aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, query, key, value, out, lse, ...)``.

    Like torch's formula of the CUDA flash backward, this counts the recomputation of the scores.
    """
    return int(sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape))


def _sdpa_backward_model_flop(
    grad_out_shape: torch.Size,
    query_shape: torch.Size,
    key_shape: torch.Size,
    value_shape: torch.Size,
    *args: Any,
    **kwargs: Any,
) -> int:
    """SDPA backward without the recomputation of ``Q K^T``: ``dV``, ``dP``, ``dQ``, ``dK`` (twice the forward)."""
    b, h_q, s_q, d_q = query_shape
    s_k = key_shape[2]
    recompute = 2 * b * h_q * s_q * d_q * s_k
    return int(sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)) - recompute


def register_cpu_sdpa_flop_formulas() -> None:
    """Give ``FlopCounterMode`` formulas for the CPU fused attention kernels (idempotent; a no-op where torch has
    its own or the ops do not exist). ``FlopCounterMode`` copies the registry when it is created: call this first.
    """
    for op_name, formula in ((_CPU_SDPA_FORWARD, _cpu_sdpa_flop), (_CPU_SDPA_BACKWARD, _cpu_sdpa_backward_flop)):
        op = getattr(aten, op_name, None)
        if op is None or op in flop_counter.flop_registry:
            continue
        register_flop_formula(op)(formula)
        log.debug("registered a FLOPs formula for aten.%s", op_name)


def measure_flops_per_token(
    model: nn.Module,
    inputs: torch.Tensor | tuple[torch.Tensor, ...],
    targets: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    count_attention_recompute: bool = False,
) -> float:
    """FLOPs per token of one forward + backward of ``loss_fn(model(inputs), targets)``, counted by
    ``torch.utils.flop_counter.FlopCounterMode`` (matmuls, convolutions, attention kernels), divided by
    ``targets.numel()``. A tuple of ``inputs`` is passed as positional arguments (e.g. an encoder-decoder's source
    and target).

    By default the attention backward is counted without the recomputation of the scores that flash-style
    kernels do (torch's formulas count it), so the result is model FLOPs, comparable with ``flops_per_token``;
    ``count_attention_recompute=True`` keeps torch's count. The gradients of the model are left as they were
    (the ones this creates are dropped); module state set by the forward (e.g. MoE statistics) is not restored.
    """
    register_cpu_sdpa_flop_formulas()
    custom: dict[Any, Any] = {}
    if not count_attention_recompute:
        for op_name in _SDPA_BACKWARD_OPS:
            op = getattr(aten, op_name, None)
            if op is not None:
                custom[op] = _sdpa_backward_model_flop
    params = list(model.parameters())
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        with FlopCounterMode(display=False, custom_mapping=custom) as counter:
            outputs = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
            loss = loss_fn(outputs, targets)
            loss.backward()
    finally:
        for p, grad in zip(params, saved, strict=True):
            p.grad = grad
    return float(counter.get_total_flops()) / targets.numel()


# --- peak and MFU ----------------------------------------------------------------------------------------------


def peak_flops(
    device_name: str,
    override: float | None = None,
    cpu_peak: float | None = None,
    *,
    table: Mapping[str, float] = PEAK_FLOPS_BF16,
) -> float:
    """Peak FLOP/s of one device, from its name (e.g. ``torch.cuda.get_device_name()``, or ``"cpu"``).

    ``override`` wins. Otherwise the longest key of ``table`` (dense BF16 peaks) contained in the name,
    case-insensitively, gives the peak. A CPU has no known peak: ``cpu_peak`` must be given. An unknown GPU is an
    error asking for ``override``.
    """
    if override is not None:
        if not override > 0 or not math.isfinite(override):
            raise ValueError(f"peak FLOP/s override must be finite and > 0, got {override}")
        return float(override)
    upper = device_name.upper()
    matches = [key for key in table if key.upper() in upper]
    if matches:
        longest = max(len(key) for key in matches)
        best = {table[key] for key in matches if len(key) == longest}
        if len(best) > 1:
            raise ValueError(f"device name {device_name!r} matches several peak-FLOPs entries {matches}; pass override")
        return float(best.pop())
    if "CPU" in upper:
        if cpu_peak is None:
            raise ValueError("peak FLOP/s of a CPU device must be configured (cpu_peak), there is no default")
        if not cpu_peak > 0 or not math.isfinite(cpu_peak):
            raise ValueError(f"cpu_peak must be finite and > 0, got {cpu_peak}")
        return float(cpu_peak)
    raise ValueError(f"unknown device {device_name!r}: no peak FLOP/s known for it; pass override")


def mfu_ratio(tokens_per_s: float, flops_per_token: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilisation: ``tokens_per_s x flops_per_token / peak_flops_per_s``, a ratio (not a percentage),
    clamped at 0 (a NaN throughput gives 0)."""
    if not peak_flops_per_s > 0 or not math.isfinite(peak_flops_per_s):
        raise ValueError(f"peak FLOP/s must be finite and > 0, got {peak_flops_per_s}")
    ratio = tokens_per_s * flops_per_token / peak_flops_per_s
    return ratio if ratio > 0 else 0.0
