"""FLOPs accounting and MFU (trainer_hooks.flops): the formula against FlopCounterMode on the reference model."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from bench.mfu_params import CASES, SEQ_LEN, Case, linear_weight_params, measure
from examples.config import ModelConfig
from examples.model import Transformer, model_shape
from examples.parallelize import lm_loss
from trainer_hooks.flops import (
    PEAK_FLOPS_BF16,
    ModelShape,
    attention_flops_per_token,
    example_token_inputs,
    flops_per_token,
    measure_flops_per_token,
    mfu_ratio,
    peak_flops,
    register_cpu_sdpa_flop_formulas,
    shape_from_module,
)
from trainer_hooks.matmul_params import count_matmul_params

# seq_len 128 with dim 64: attention is 19-29% of the FLOPs, so a missing attention formula cannot hide in 2%.
BASE = {"dim": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 96, "seq_len": 128, "n_layers": 2}
CONFIGS = {
    "dense": ModelConfig(**BASE),
    "moe_e4_k2": ModelConfig(**BASE, n_experts=4, top_k=2),
    "moe_e8_k2_shared1": ModelConfig(**BASE, n_experts=8, top_k=2, n_shared_experts=1),
}


def build(cfg: ModelConfig) -> tuple[Transformer, ModelShape]:
    torch.manual_seed(0)
    model = Transformer(cfg)
    shape = model_shape(model)
    return model, shape


def batch(cfg: ModelConfig, seq_len: int | None = None, batch_size: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    s = seq_len or cfg.seq_len
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, s + 1))
    return tokens[:, :-1], tokens[:, 1:]


def test_shape_from_module_counts_the_matmuls_of_the_reference_model() -> None:
    cfg = CONFIGS["moe_e8_k2_shared1"]
    _, shape = build(cfg)
    d, hd, f = cfg.dim, cfg.head_dim, cfg.ffn_hidden
    attention = d * cfg.n_heads * hd * 2 + d * cfg.n_kv_heads * hd * 2
    router, shared, expert = d * cfg.n_experts, 3 * d * f * cfg.n_shared_experts, 3 * d * f
    assert shape.dense_matmul_params == cfg.n_layers * (attention + router + shared) + d * cfg.vocab_size
    assert shape.expert_matmul_params == cfg.n_layers * expert
    assert shape.active_matmul_params == shape.dense_matmul_params + cfg.top_k * shape.expert_matmul_params


def test_shape_from_module_dense_ignores_embeddings_and_norms() -> None:
    cfg = CONFIGS["dense"]
    model, shape = build(cfg)
    d, hd = cfg.dim, cfg.head_dim
    per_layer = d * cfg.n_heads * hd * 2 + d * cfg.n_kv_heads * hd * 2 + 3 * d * cfg.ffn_hidden
    assert shape.dense_matmul_params == cfg.n_layers * per_layer + d * cfg.vocab_size
    all_params = sum(p.numel() for p in model.parameters())
    assert all_params - shape.dense_matmul_params == cfg.vocab_size * d + (2 * cfg.n_layers + 1) * d


class _TorchtitanStyleMoE(nn.Module):
    """Routed experts as ``nn.Linear``s under ``experts``, shared ones under ``shared_experts``."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 4, bias=False)
        self.experts = nn.ModuleList(nn.Linear(8, 16, bias=False) for _ in range(4))
        self.shared_experts = nn.Linear(8, 16, bias=False)


def test_shape_from_module_routed_experts_by_name_not_shared_experts() -> None:
    shape = shape_from_module(_TorchtitanStyleMoE(), n_layers=1, n_heads=1, head_dim=8, seq_len=4, n_experts=4, top_k=2)
    assert shape.dense_matmul_params == 8 * 4 + 8 * 16
    assert shape.expert_matmul_params == 8 * 16


def test_shape_from_module_custom_expert_filter() -> None:
    shape = shape_from_module(
        _TorchtitanStyleMoE(),
        n_layers=1,
        n_heads=1,
        head_dim=8,
        seq_len=4,
        n_experts=5,
        top_k=1,
        expert_param_filter=lambda name: "experts" in name,  # shared_experts counted as a fifth expert
    )
    assert shape.dense_matmul_params == 8 * 4
    assert shape.expert_matmul_params == 8 * 16


@pytest.mark.parametrize(
    ("cfg", "n_experts", "message"),
    [
        pytest.param(CONFIGS["moe_e4_k2"], 0, "n_experts=0", id="experts-found-but-dense-declared"),
        pytest.param(CONFIGS["dense"], 4, "no parameter matched", id="no-experts-found"),
        pytest.param(CONFIGS["moe_e4_k2"], 5, "not divisible", id="expert-count-mismatch"),
    ],
)
def test_shape_from_module_rejects_inconsistent_expert_counts(cfg: ModelConfig, n_experts: int, message: str) -> None:
    model, _ = build(cfg)
    with pytest.raises(ValueError, match=message):
        shape_from_module(model, n_layers=2, n_heads=4, head_dim=16, seq_len=128, n_experts=n_experts, top_k=1)


# --- matmul parameters traced on the meta device, against FlopCounterMode -----------------------------------------

CASES_BY_KEY = {case.key: case for case in CASES}


@pytest.mark.parametrize("case", CASES, ids=[case.key for case in CASES])
def test_traced_formula_matches_flop_counter(case: Case) -> None:
    """Exact up to float rounding: the formula and FlopCounterMode count the same matmuls (neither counts bias
    adds, norms, softmax or elementwise ops) and the same full S x S attention (torch's SDPA formulas ignore the
    causal mask too; the CPU fused kernels' formulas are registered by measure_flops_per_token, the math path and
    nn.MultiheadAttention's own attention are bmm)."""
    model, shape, row = measure(case)
    assert row.traced_flops == pytest.approx(row.measured_flops, rel=1e-9)
    assert row.measured_flops - 6 * shape.active_matmul_params == pytest.approx(attention_flops_per_token(shape))
    assert all(p.grad is None and p.device.type == "cpu" for p in model.parameters())


def _in_proj(*layers: str) -> set[str]:
    return {f"{layer}.in_proj_weight" for layer in layers}


# The matmul parameters that nn.Linear weights alone miss.
MISSED_BY_LINEAR_WEIGHTS: dict[str, set[str]] = {
    "encoder_layer": _in_proj("self_attn"),
    "multihead_attention": _in_proj("attention"),
    "decoder_layer": _in_proj("self_attn", "multihead_attn"),
    "transformer": _in_proj(
        "encoder.layers.0.self_attn",
        "encoder.layers.1.self_attn",
        *(f"decoder.layers.{i}.{attention}" for i in (0, 1) for attention in ("self_attn", "multihead_attn")),
    ),
    "tied_lm": {"embed.weight"} | _in_proj("encoder.layers.0.self_attn", "encoder.layers.1.self_attn"),
    "functional": {"qkv", "proj", "up", "down"},
}


@pytest.mark.parametrize(("key", "missed"), list(MISSED_BY_LINEAR_WEIGHTS.items()), ids=list(MISSED_BY_LINEAR_WEIGHTS))
def test_nn_linear_weights_alone_under_count(key: str, missed: set[str]) -> None:
    case = CASES_BY_KEY[key]
    model, _, row = measure(case)
    inputs, _ = case.batch()
    counted = count_matmul_params(model, example_token_inputs(model, SEQ_LEN) if case.tokens else inputs)
    assert counted.static_modules == ()
    assert missed <= counted.dense.keys()
    assert sum(counted.dense[name] for name in missed) == row.traced_params - row.linear_params
    assert row.linear_params == linear_weight_params(model)
    assert row.linear_ratio < 0.75  # what counting nn.Linear weights reported: far outside any tolerance


def _linear_chain(d: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d))


class _Functional(nn.Module):
    """``forward`` written as ``fn(self, x)``, parameters ``name -> shape``."""

    def __init__(self, fn: Any, **shapes: tuple[int, ...]) -> None:
        super().__init__()
        self.fn = fn
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.randn(shape)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self, x)


class _TiedLinearLM(nn.Module):
    def __init__(self, vocab: int, d: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.hidden = nn.Linear(d, d, bias=False)
        self.output = nn.Linear(d, vocab, bias=False)
        self.output.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.output(self.hidden(self.embed(tokens)))


class _LookupOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 4, bias=False)
        self.unused = nn.Linear(8, 8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


class _DataDependent(nn.Module):
    """Routes on a value (``.item()``): cannot run on the meta device."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d, bias=False)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.proj(x) if x.sum().item() > 0 else x


class _Routed(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.inner = nn.Parameter(torch.randn(d, d))
        self.routed = _DataDependent(d)
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last = x
        return self.routed(F.linear(x, self.inner))


X8 = torch.randn(2, 5, 8)

MATMUL_PARAM_CASES = [
    pytest.param(_linear_chain(8), X8, {"0.weight": 64, "2.weight": 64}, (), id="linear-weights-not-biases"),
    pytest.param(
        _Functional(lambda m, x: F.linear(F.linear(x, m.w), m.w), w=(8, 8)), X8, {"w": 128}, (), id="used-twice"
    ),
    pytest.param(
        _Functional(lambda m, x: x @ m.w.to(torch.float64).float(), w=(8, 3)), X8, {"w": 24}, (), id="dtype-cast"
    ),
    pytest.param(
        _Functional(lambda m, x: sum((x @ m.w[i]).relu() for i in range(3)), w=(3, 8, 8)),
        X8,
        {"w": 3 * 64},
        (),
        id="slices-of-stacked-weights",
    ),
    pytest.param(
        _Functional(lambda m, x: torch.bmm(x, m.w.expand(x.shape[0], 8, 4)), w=(8, 4)),
        X8,
        {"w": 32},
        (),
        id="broadcast-weight-counts-once",
    ),
    pytest.param(
        _Functional(lambda m, x: torch.einsum("bsd,kd->bsk", x, m.w), w=(6, 8)), X8, {"w": 48}, (), id="einsum"
    ),
    pytest.param(_Functional(lambda m, x: x @ (m.a @ m.b), a=(8, 2), b=(2, 8)), X8, {}, (), id="product-of-parameters"),
    pytest.param(_TiedLinearLM(32, 8), None, {"embed.weight": 256, "hidden.weight": 64}, (), id="tied-output-once"),
    pytest.param(_LookupOnly(), None, {"head.weight": 32}, (), id="lookup-and-unused-linear-not-counted"),
    pytest.param(_Routed(8), X8, {"inner": 64, "routed.proj.weight": 64}, ("routed",), id="data-dependent-submodule"),
    pytest.param(_linear_chain(8), torch.randn(2, 5, 3), {"0.weight": 64, "2.weight": 64}, ("",), id="bad-input"),
    pytest.param(
        nn.MultiheadAttention(8, 2), None, {"in_proj_weight": 192, "out_proj.weight": 64}, ("",), id="no-input"
    ),
]


@pytest.mark.parametrize(("module", "inputs", "dense", "static_modules"), MATMUL_PARAM_CASES)
def test_count_matmul_params(
    module: nn.Module, inputs: torch.Tensor | None, dense: dict[str, int], static_modules: tuple[str, ...]
) -> None:
    if inputs is None and any(isinstance(sub, nn.Embedding) for sub in module.modules()):
        inputs = torch.zeros(1, 16, dtype=torch.long)
    counted = count_matmul_params(module, inputs)
    assert dict(counted.dense) == dense
    assert counted.static_modules == static_modules


def test_tracing_leaves_the_module_and_the_random_state_alone() -> None:
    module = _Routed(8)
    before = {name: (p.device, p.clone()) for name, p in module.named_parameters()}
    rng = torch.random.get_rng_state()
    for _ in range(2):
        count_matmul_params(module, X8)
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert module.last is None
    assert module.routed.calls == 0
    assert "forward" not in vars(module.routed)
    assert not module.routed._forward_hooks
    assert not module.routed._forward_pre_hooks
    for name, p in module.named_parameters():
        assert p.device == before[name][0]
        torch.testing.assert_close(p, before[name][1], rtol=0, atol=0)
    y = module(X8.abs())  # still a working module
    assert y.shape == X8.shape
    assert module.routed.calls == 1


def test_an_untraceable_forward_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    shape = shape_from_module(
        _linear_chain(8), n_layers=1, n_heads=1, head_dim=8, seq_len=5, example_inputs=torch.randn(1, 5, 3)
    )
    assert shape.dense_matmul_params == 128
    assert "cannot be traced on the meta device" in caplog.text


def test_shape_from_module_takes_example_kwargs() -> None:
    layer = nn.TransformerDecoderLayer(16, 2, 32, batch_first=True)
    tgt, memory = torch.randn(1, 4, 16), torch.randn(1, 4, 16)
    by_kwargs = shape_from_module(
        layer, n_layers=2, n_heads=2, head_dim=8, seq_len=4, example_kwargs={"tgt": tgt, "memory": memory}
    )
    by_args = shape_from_module(layer, n_layers=2, n_heads=2, head_dim=8, seq_len=4, example_inputs=(tgt, memory))
    assert by_kwargs.dense_matmul_params == by_args.dense_matmul_params == 2 * 4 * 16 * 16 + 2 * 16 * 32


def test_reference_moe_routing_is_counted_by_its_linear_weights() -> None:
    """The MoE layer's routing (token counts) cannot run on the meta device: its router and shared experts are
    nn.Linear weights, its routed experts are counted by name; the rest of the model is traced."""
    cfg = CONFIGS["moe_e8_k2_shared1"]
    with torch.device("meta"):
        model = Transformer(cfg)
    counted = count_matmul_params(model, example_token_inputs(model, cfg.seq_len))
    assert counted.static_modules == ("layers.0.feed_forward", "layers.1.feed_forward")
    assert "layers.1.feed_forward.router.weight" in counted.dense
    assert "layers.1.attention.wq.weight" in counted.dense
    assert set(counted.experts) == {f"layers.{i}.feed_forward.experts.w{j}" for i in (0, 1) for j in (1, 2, 3)}
    assert model_shape(model) == build(cfg)[1]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_formula_matches_measured_flops(name: str) -> None:
    cfg = CONFIGS[name]
    model, shape = build(cfg)
    inputs, targets = batch(cfg)
    measured = measure_flops_per_token(model, inputs, targets, lm_loss)
    expected = flops_per_token(shape)
    assert attention_flops_per_token(shape) / expected > 0.15
    assert measured == pytest.approx(expected, rel=0.02)
    assert all(p.grad is None for p in model.parameters())


def _ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_measured_attention_flops_are_the_attention_term() -> None:
    cfg = CONFIGS["moe_e4_k2"]
    model, shape = build(cfg)
    inputs, targets = batch(cfg)
    measured = measure_flops_per_token(model, inputs, targets, _ce)
    attention = measured - 6 * shape.active_matmul_params
    assert attention == pytest.approx(12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * cfg.seq_len, rel=0.01)


def test_longer_sequences_add_the_attention_delta() -> None:
    cfg = CONFIGS["dense"]
    model, _ = build(cfg)
    short = measure_flops_per_token(model, *batch(cfg, seq_len=32, batch_size=4), lm_loss)
    full = measure_flops_per_token(model, *batch(cfg, seq_len=128), lm_loss)
    expected_delta = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * (128 - 32)
    assert full - short == pytest.approx(expected_delta, rel=0.01)


def test_attention_recompute_is_counted_only_on_request() -> None:
    cfg = CONFIGS["dense"]
    model, _ = build(cfg)
    inputs, targets = batch(cfg)
    model_flops = measure_flops_per_token(model, inputs, targets, lm_loss)
    with_recompute = measure_flops_per_token(model, inputs, targets, lm_loss, count_attention_recompute=True)
    # One extra Q K^T in the backward: 2 x seq_len x head_dim per token, head and layer.
    assert with_recompute - model_flops == pytest.approx(2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * cfg.seq_len)


def _sdpa_flops(remove_cpu_formulas: bool) -> dict[str, int]:
    register_cpu_sdpa_flop_formulas()
    b, h, s, d = 2, 4, 64, 16
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    counter = FlopCounterMode(display=False)
    if remove_cpu_formulas:
        for op in (
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward,
        ):
            counter.flop_registry.pop(op, None)
    with counter:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    return {str(op): n for op, n in counter.get_flop_counts().get("Global", {}).items()}


def test_cpu_sdpa_kernels_are_counted_after_registration() -> None:
    b, h, s, d = 2, 4, 64, 16
    counts = _sdpa_flops(remove_cpu_formulas=False)
    assert counts == {
        "aten._scaled_dot_product_flash_attention_for_cpu": 4 * b * h * s * s * d,
        "aten._scaled_dot_product_flash_attention_for_cpu_backward": 10 * b * h * s * s * d,  # torch's, with recompute
    }


def test_cpu_sdpa_kernels_are_missing_without_a_formula() -> None:
    assert _sdpa_flops(remove_cpu_formulas=True) == {}


def test_register_cpu_sdpa_flop_formulas_is_idempotent() -> None:
    register_cpu_sdpa_flop_formulas()
    register_cpu_sdpa_flop_formulas()  # torch raises on a duplicate registration


def test_measure_keeps_existing_gradients() -> None:
    cfg = CONFIGS["dense"]
    model, _ = build(cfg)
    inputs, targets = batch(cfg)
    lm_loss(model(inputs), targets).backward()
    before = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    assert before
    measure_flops_per_token(model, inputs, targets, lm_loss)
    for name, p in model.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(p.grad, before[name], rtol=0, atol=0)


def test_flops_per_token_formula() -> None:
    shape = ModelShape(
        n_layers=2,
        n_heads=4,
        head_dim=8,
        seq_len=16,
        dense_matmul_params=1000,
        expert_matmul_params=100,
        n_experts=8,
        top_k=2,
    )
    assert shape.active_matmul_params == 1200
    assert attention_flops_per_token(shape) == 12 * 2 * 4 * 8 * 16
    assert flops_per_token(shape) == 6 * 1200 + 12 * 2 * 4 * 8 * 16


def test_dense_shape_ignores_top_k() -> None:
    shape = ModelShape(n_layers=1, n_heads=1, head_dim=2, seq_len=4, dense_matmul_params=10, top_k=2)
    assert shape.active_matmul_params == 10


VALID_SHAPE: dict[str, Any] = {
    "n_layers": 2,
    "n_heads": 4,
    "head_dim": 8,
    "seq_len": 16,
    "dense_matmul_params": 1000,
    "expert_matmul_params": 100,
    "n_experts": 8,
    "top_k": 2,
}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        pytest.param({"n_layers": 0}, r"model_shape\.n_layers must be", id="no-layers"),
        pytest.param({"n_heads": -1}, r"model_shape\.n_heads must be", id="negative-heads"),
        pytest.param({"head_dim": 0}, r"model_shape\.head_dim must be", id="zero-head-dim"),
        pytest.param({"seq_len": 2.5}, r"model_shape\.seq_len must be", id="float-seq-len"),
        pytest.param({"seq_len": True}, r"model_shape\.seq_len must be", id="bool-seq-len"),
        pytest.param({"dense_matmul_params": -1}, r"model_shape\.dense_matmul_params must be", id="negative-dense"),
        pytest.param({"expert_matmul_params": -5}, r"model_shape\.expert_matmul_params must be", id="negative-expert"),
        pytest.param({"n_experts": -1}, r"model_shape\.n_experts must be", id="negative-experts"),
        pytest.param({"top_k": 0}, r"model_shape\.top_k must be", id="moe-top-k-zero"),
        pytest.param({"top_k": 9}, r"model_shape\.top_k must be", id="top-k-over-experts"),
        pytest.param({"n_experts": 0}, r"model_shape\.expert_matmul_params must be 0", id="dense-with-experts"),
        pytest.param(
            {"dense_matmul_params": 0, "expert_matmul_params": 0, "n_experts": 0},
            r"model_shape\.dense_matmul_params must be > 0",
            id="no-params",
        ),
    ],
)
def test_model_shape_validation(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelShape(**{**VALID_SHAPE, **changes})


@pytest.mark.parametrize(
    ("device_name", "kwargs", "expected"),
    [
        pytest.param("NVIDIA A100-SXM4-80GB", {}, 312e12, id="a100"),
        pytest.param("NVIDIA H100 80GB HBM3", {}, 989e12, id="h100"),
        pytest.param("NVIDIA H200", {}, 989e12, id="h200"),
        pytest.param("NVIDIA B200", {}, 2.25e15, id="b200"),
        pytest.param("AMD Instinct MI300X", {}, 1.3e15, id="mi300x"),
        pytest.param("nvidia h100 pcie", {}, 989e12, id="case-insensitive"),
        pytest.param("NVIDIA H100", {"override": 5e14}, 5e14, id="override-wins-over-table"),
        pytest.param("cpu", {"override": 1e11}, 1e11, id="override-wins-over-cpu"),
        pytest.param("Some Future GPU", {"override": 7e15}, 7e15, id="override-for-unknown-gpu"),
        pytest.param("cpu", {"cpu_peak": 2e11}, 2e11, id="cpu-with-peak"),
        pytest.param("Intel(R) Xeon(R) CPU @ 2.2GHz", {"cpu_peak": 3e11}, 3e11, id="cpu-in-name"),
        pytest.param("AMD Instinct MI300X", {"table": {"MI300": 1.0, "MI300X": 2.0}}, 2.0, id="longest-key-wins"),
        pytest.param("AMD Instinct MI300A", {"table": {"MI300": 1.0, "MI300X": 2.0}}, 1.0, id="shorter-key-alone"),
    ],
)
def test_peak_flops(device_name: str, kwargs: dict[str, Any], expected: float) -> None:
    assert peak_flops(device_name, **kwargs) == expected


@pytest.mark.parametrize(
    ("device_name", "kwargs", "message"),
    [
        pytest.param("cpu", {}, "CPU device must be configured", id="cpu-without-peak"),
        pytest.param("NVIDIA GeForce RTX 4090", {}, "'NVIDIA GeForce RTX 4090'.*pass override", id="unknown-gpu"),
        pytest.param("NVIDIA H100", {"override": 0.0}, "override must be", id="zero-override"),
        pytest.param("cpu", {"cpu_peak": -1.0}, "cpu_peak must be", id="negative-cpu-peak"),
        pytest.param("X1 X2", {"table": {"X1": 1.0, "X2": 2.0}}, "several", id="ambiguous-equal-length-keys"),
    ],
)
def test_peak_flops_errors(device_name: str, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        peak_flops(device_name, **kwargs)


def test_peak_table_is_dense_bf16_per_gpu() -> None:
    assert PEAK_FLOPS_BF16 == {"A100": 312e12, "H100": 989e12, "H200": 989e12, "B200": 2.25e15, "MI300X": 1.3e15}


@pytest.mark.parametrize(
    ("tokens_per_s", "flops", "peak", "expected"),
    [
        pytest.param(1000.0, 6e9, 1e13, 0.6, id="ratio-not-percent"),
        pytest.param(2000.0, 6e9, 1e13, 1.2, id="above-one-not-clamped"),
        pytest.param(0.0, 6e9, 1e13, 0.0, id="idle"),
        pytest.param(-5.0, 6e9, 1e13, 0.0, id="negative-clamped"),
        pytest.param(float("nan"), 6e9, 1e13, 0.0, id="nan-throughput"),
    ],
)
def test_mfu_ratio(tokens_per_s: float, flops: float, peak: float, expected: float) -> None:
    assert mfu_ratio(tokens_per_s, flops, peak) == pytest.approx(expected)


@pytest.mark.parametrize("peak", [0.0, -1e12, float("inf"), float("nan")])
def test_mfu_ratio_rejects_bad_peak(peak: float) -> None:
    with pytest.raises(ValueError, match="peak FLOP/s must be"):
        mfu_ratio(1000.0, 6e9, peak)
