"""The parallelism and memory planner: the literature's worked examples and the planner's invariants, as tables of
named cases."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from rich.table import Table

from opsd.analysis.planner import (
    PRESETS,
    BytesPerParam,
    Mesh,
    ModelSpec,
    PlanOptions,
    activation_bytes,
    bubble_ratio,
    comm_bytes,
    layer_activation_bytes,
    mesh_text,
    model_state_bytes,
    parameter_count,
    parse_mesh,
    plan,
    plan_to_dict,
    preset,
    render_table,
    render_text,
)

ROOT = Path(__file__).resolve().parent.parent
L8B, L70B, L405B = preset("llama3-8b"), preset("llama3-70b"), preset("llama3-405b")
TINY = ModelSpec("tiny", layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=100)


PARAMETER_CASES = {
    "llama3-8b": ("llama3-8b", 8.03e9),
    "llama3-70b": ("llama3-70b", 70.6e9),
    "llama3-405b": ("llama3-405b", 405.9e9),
}


@pytest.mark.parametrize(("name", "expected"), PARAMETER_CASES.values(), ids=PARAMETER_CASES.keys())
def test_preset_parameter_counts(name: str, expected: float) -> None:
    assert parameter_count(PRESETS[name]) == pytest.approx(expected, rel=0.01)


def test_parameter_count_of_a_custom_model() -> None:
    # per layer: attention 2*64^2 + 2*64*(2*16) = 12288, MLP 3*64*128 = 24576, norms 128; embeddings 2*100*64; norm 64
    assert parameter_count(TINY) == 4 * (12288 + 24576 + 128) + 12800 + 64
    moe = dataclasses.replace(TINY, experts=4, experts_per_token=2)
    assert parameter_count(moe) == 4 * (12288 + 64 * 4 + 4 * 24576 + 128) + 12800 + 64


STATE_CASES = {
    # ZeRO paper: 70B parameters x 16 bytes of mixed-precision Adam state, unsharded
    "70B x 16 B = 1.12 TB": (70e9, "none", 1, BytesPerParam(), 1.12e12),
    # 405B parameters at 12 B each (bf16 weights and gradients, 8 B of optimizer state), ZeRO-3 over 1,024 GPUs
    "405B x 12 B / 1024 = 4.746 GB": (405e9, "zero3", 1024, BytesPerParam(2, 2, 8), 405e9 * 12 / 1024),
    "fsdp is zero3": (405e9, "fsdp", 1024, BytesPerParam(2, 2, 8), 4.74609375e9),
    "zero1: 4 + 12/N": (1e9, "zero1", 4, BytesPerParam(), 1e9 * (4 + 12 / 4)),
    "zero2: 2 + 14/N": (1e9, "zero2", 4, BytesPerParam(), 1e9 * (2 + 14 / 4)),
}


@pytest.mark.parametrize(
    ("params", "sharding", "shard", "bpp", "expected_bytes"), STATE_CASES.values(), ids=STATE_CASES.keys()
)
def test_model_state_worked_examples(
    params: float, sharding: str, shard: int, bpp: BytesPerParam, expected_bytes: float
) -> None:
    assert model_state_bytes(params, sharding, shard, bpp).total_bytes == pytest.approx(expected_bytes, rel=1e-12)


def test_405b_preset_under_zero3_over_1024_gpus_holds_about_4_75_gb_of_state() -> None:
    p = plan(L405B, Mesh(dp_shard=1024), PlanOptions(sharding="zero3", bytes_per_param=BytesPerParam(2, 2, 8)))
    state = p.memory.total_bytes - p.memory.activations_bytes
    assert state == pytest.approx(parameter_count(L405B) * 12 / 1024)
    assert state == pytest.approx(4.75e9, rel=0.01)


BUBBLE_CASES = {
    "p=4 m=8: 27.3%": (4, 8, 3 / 11, 0.273),
    "p=16 m=64: 19.0%": (16, 64, 15 / 79, 0.190),
    "no pipeline": (1, 8, 0.0, 0.0),
    "one micro-batch": (8, 1, 7 / 8, 0.875),
}


@pytest.mark.parametrize(("p", "m", "exact", "rounded"), BUBBLE_CASES.values(), ids=BUBBLE_CASES.keys())
def test_bubble(p: int, m: int, exact: float, rounded: float) -> None:
    assert bubble_ratio(p, m) == exact
    assert round(bubble_ratio(p, m), 3) == rounded


ORDER_CASES = {
    "8b on 8": (L8B, "dp_shard=8"),
    "70b tp=8 on 64": (L70B, "dp_shard=8,tp=8"),
    "405b 3d on 16k": (L405B, "dp_shard=128,tp=8,pp=16"),
    "hsdp with cp": (L70B, "dp_replicate=2,dp_shard=4,cp=2,tp=8"),
    "one shard: all equal": (L8B, "dp_replicate=8"),
}


@pytest.mark.parametrize(("model", "mesh"), ORDER_CASES.values(), ids=ORDER_CASES.keys())
def test_each_zero_stage_uses_no_more_memory_than_the_previous(model: ModelSpec, mesh: str) -> None:
    totals = [
        plan(model, parse_mesh(mesh), PlanOptions(sharding=s, micro_batches=16)).memory.total_bytes
        for s in ("none", "zero1", "zero2", "zero3")
    ]
    assert totals == sorted(totals, reverse=True)
    fsdp = plan(model, parse_mesh(mesh), PlanOptions(sharding="fsdp", micro_batches=16))
    assert fsdp.memory.total_bytes == totals[-1]


@pytest.mark.parametrize("sharding", ["none", "zero1", "zero2", "zero3"])
def test_tensor_parallel_halves_the_weights(sharding: str) -> None:
    options = PlanOptions(sharding=sharding)
    one, two = (plan(L70B, Mesh(dp_shard=8, tp=t), options) for t in (1, 2))
    assert one.memory.weights_bytes == 2 * two.memory.weights_bytes
    assert one.memory.activations_bytes == 2 * two.memory.activations_bytes  # sequence parallel: all divided by t


S, B, H, A = 8192, 2, 4096, 32  # the 8B model's hidden size and heads
LAYER_CASES = {
    "none, no tp": (Mesh(), "none", True, S * B * H * (34 + 5 * A * S / H)),
    "none, tp=8 with sp": (Mesh(tp=8), "none", True, S * B * H * (34 / 8 + 5 * A * S / (H * 8))),
    "none, tp=8 without sp": (Mesh(tp=8), "none", False, S * B * H * (10 + 24 / 8 + 5 * A * S / (H * 8))),
    "selective, tp=4": (Mesh(tp=4), "selective", True, S * B * H * 34 / 4),
    "full, no tp": (Mesh(), "full", True, 2 * S * B * H),
    "full, tp=4 with sp": (Mesh(tp=4), "full", True, 2 * S * B * H / 4),
    "selective, cp=2": (Mesh(cp=2), "selective", True, (S / 2) * B * H * 34),
    "none, cp=4: local queries x all keys": (Mesh(cp=4), "none", True, (S / 4) * B * H * 34 + 5 * A * (S / 4) * S * B),
}


@pytest.mark.parametrize(("mesh", "mode", "sp", "expected"), LAYER_CASES.values(), ids=LAYER_CASES.keys())
def test_layer_activations_follow_korthikanti(mesh: Mesh, mode: str, sp: bool, expected: float) -> None:
    options = PlanOptions(micro_batch_size=B, seq_len=S, checkpointing=mode, sequence_parallel=sp)
    assert layer_activation_bytes(L8B, mesh, options) == pytest.approx(expected, rel=1e-12)


INFLIGHT_CASES = {
    "p=4, m=8: p micro-batches of L/p layers": (4, 8, 4 * 8),
    "p=4, m=2: only m in flight": (4, 2, 2 * 8),
}


@pytest.mark.parametrize(("pp", "m", "layer_passes"), INFLIGHT_CASES.values(), ids=INFLIGHT_CASES.keys())
def test_first_pipeline_stage_holds_the_micro_batches_in_flight(pp: int, m: int, layer_passes: int) -> None:
    options = PlanOptions(seq_len=S, micro_batches=m)
    per_layer = layer_activation_bytes(L8B, Mesh(pp=pp), options)
    assert activation_bytes(L8B, Mesh(pp=pp), options) == pytest.approx(layer_passes * per_layer)


def test_without_pipeline_the_logits_are_added_and_full_recompute_keeps_one_layer() -> None:
    options = PlanOptions(seq_len=S, micro_batches=4)
    logits = 4 * S * (H + L8B.vocab)
    assert activation_bytes(L8B, Mesh(), options) == pytest.approx(32 * S * H * 34 + logits)
    full = dataclasses.replace(options, checkpointing="full")
    one_layer = S * H * (34 + 5 * A * S / H)
    assert activation_bytes(L8B, Mesh(), full) == pytest.approx(32 * 2 * S * H + logits + one_layer)


P8B = parameter_count(L8B)
COMM_CASES = {
    "ddp: ring all-reduce of bf16 gradients": ("dp_shard=8", "none", 1, "dp_bytes", 2 * 7 / 8 * 2 * P8B),
    "zero1: reduce-scatter + all-gather": ("dp_shard=8", "zero1", 4, "dp_bytes", 7 / 8 * 4 * P8B),
    "zero3: 2 gathers + 1 reduce-scatter per micro-batch": ("dp_shard=8", "zero3", 2, "dp_bytes", 7 / 8 * 12 * P8B),
    "hsdp adds the replica all-reduce of the shard": (
        "dp_replicate=2,dp_shard=4",
        "zero3",
        1,
        "dp_bytes",
        (3 / 4 * 6 + 2 * 1 / 2 * 2 / 4) * P8B,
    ),
    "tp: 8 ring passes of the hidden states per layer": (
        "tp=4",
        "zero3",
        2,
        "tp_bytes",
        8 * 3 / 4 * 2 * S * H * 32 * 2,
    ),
    "pp: activation out, gradient back": ("pp=4,tp=2", "zero3", 8, "pp_bytes", 2 * 8 * 2 * S * H / 2),
    "cp: all-gather of K and V, reduce-scatter back": (
        "cp=2",
        "zero3",
        1,
        "cp_bytes",
        2 * 1 / 2 * 2 * 2 * S * 8 * 128 * 32,
    ),
    "nothing over a dimension of 1": ("dp_shard=8", "zero3", 1, "tp_bytes", 0.0),
}


@pytest.mark.parametrize(("mesh", "sharding", "m", "field", "expected"), COMM_CASES.values(), ids=COMM_CASES.keys())
def test_communication_volume(mesh: str, sharding: str, m: int, field: str, expected: float) -> None:
    comm = comm_bytes(L8B, parse_mesh(mesh), PlanOptions(sharding=sharding, seq_len=S, micro_batches=m))
    assert getattr(comm, field) == pytest.approx(expected, rel=1e-12)


def test_expert_parallel_shards_the_experts_and_sends_all_to_alls() -> None:
    moe = dataclasses.replace(TINY, experts=8, experts_per_token=2)
    options = PlanOptions(sharding="none", seq_len=64)
    one, four = (plan(moe, Mesh(ep=e), options) for e in (1, 4))
    experts = 4 * 8 * 3 * 64 * 128
    assert one.parameters_per_gpu - four.parameters_per_gpu == experts * 3 / 4
    assert one.comm.ep_bytes == 0.0
    assert four.comm.ep_bytes == pytest.approx(4 * 3 / 4 * 2 * 64 * 64 * 2 * 4)


def test_a_config_that_does_not_fit_names_the_shortfall() -> None:
    p = plan(L70B, Mesh(dp_shard=8), PlanOptions(sharding="none"))
    assert not p.fits
    short_gb = (p.memory.total_bytes - 80e9) / 1e9
    assert p.headroom_bytes == pytest.approx(-short_gb * 1e9)
    assert f"short by {short_gb:.2f} GB" in p.verdict
    assert "largest part: optimizer state" in p.verdict
    assert p.verdict.startswith("does not fit")


def test_a_config_that_fits_says_how_much_is_free() -> None:
    p = plan(L8B, Mesh(dp_shard=8), PlanOptions(sharding="zero3"))
    assert p.fits
    assert p.verdict == (
        f"fits: {p.memory.total_bytes / 1e9:.2f} GB of 80.00 GB per GPU ({p.headroom_bytes / 1e9:.2f} GB free)"
    )


def test_parse_mesh() -> None:
    mesh = parse_mesh("dp_shard=128,tp=8,pp=16,cp=1")
    assert mesh == Mesh(dp_shard=128, tp=8, pp=16)
    assert mesh.world_size == 16384
    assert parse_mesh(mesh_text(mesh)) == mesh
    assert parse_mesh(" ep=2 , dp_replicate=3, ") == Mesh(dp_replicate=3, ep=2)


ERROR_CASES: dict[str, tuple[Callable[[], object], str]] = {
    "zero micro-batches": (lambda: PlanOptions(micro_batches=0), "plan.micro_batches must be >= 1, got 0"),
    "fractional seq_len": (lambda: PlanOptions(seq_len=1.5), "plan.seq_len must be an integer"),  # type: ignore[arg-type]
    "unknown sharding": (lambda: PlanOptions(sharding="zero4"), "plan.sharding must be one of none, zero1"),
    "unknown checkpointing": (lambda: PlanOptions(checkpointing="some"), "plan.checkpointing must be one of"),
    "no gpu memory": (lambda: PlanOptions(gpu_memory_bytes=0), "plan.gpu_memory_bytes must be > 0"),
    "negative optimizer bytes": (
        lambda: BytesPerParam(optimizer_bytes=-1),
        "bytes_per_param.optimizer_bytes must be >= 0",
    ),
    "zero degree": (lambda: Mesh(tp=0), "mesh: tp must be an integer >= 1, got 0"),
    "unknown dimension": (lambda: parse_mesh("dp=2"), "mesh: unknown dimension 'dp'"),
    "no degree": (lambda: parse_mesh("tp"), "mesh: expected NAME=DEGREE, got 'tp'"),
    "degree not a number": (lambda: parse_mesh("tp=x"), "mesh: degree of tp must be an integer, got 'x'"),
    "dimension twice": (lambda: parse_mesh("tp=2,tp=4"), "mesh: dimension 'tp' given twice"),
    "hidden not split by heads": (
        lambda: dataclasses.replace(TINY, heads=3),
        r"model.hidden \(64\) must be a multiple of model.heads \(3\)",
    ),
    "unknown preset": (lambda: preset("gpt-5"), "model: unknown preset 'gpt-5'; known: llama3-8b"),
    "tp does not divide heads": (
        lambda: plan(L8B, Mesh(tp=3), PlanOptions()),
        r"mesh.tp \(3\) must divide model.heads",
    ),
    "more stages than layers": (
        lambda: plan(TINY, Mesh(pp=8), PlanOptions()),
        r"mesh.pp \(8\) must be <= model.layers",
    ),
    "sequence not split by cp": (
        lambda: plan(L8B, Mesh(cp=3), PlanOptions(seq_len=8192)),
        r"plan.seq_len \(8192\) must be a multiple of cp x tp \(3\)",
    ),
    "bubble of no stages": (lambda: bubble_ratio(0, 4), "stages and micro_batches must be >= 1"),
}


@pytest.mark.parametrize(("make", "message"), ERROR_CASES.values(), ids=ERROR_CASES.keys())
def test_invalid_input_raises_a_clear_value_error(make: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_renderings_show_every_figure() -> None:
    p = plan(L405B, parse_mesh("dp_shard=128,tp=8,pp=16"), PlanOptions(micro_batches=64))
    text = render_text(p)
    for needle in ("weights", "optimizer state", "activations", "total per GPU", "19.0%", "tp sent", p.verdict):
        assert needle in text
    table = render_table(p)
    assert isinstance(table, Table)
    assert table.row_count == len(text.splitlines())
    data = json.loads(json.dumps(plan_to_dict(p)))
    assert data["memory"]["total_bytes"] == p.memory.total_bytes
    assert data["mesh"]["world_size"] == 16384
    assert data["comm"]["pp_bytes"] == p.comm.pp_bytes
    assert (data["fits"], data["verdict"]) == (p.fits, p.verdict)


def test_the_cli_prints_a_plan_and_exits_1_when_it_does_not_fit() -> None:
    import json

    from typer.testing import CliRunner

    from opsd.cli.app import app

    runner = CliRunner()
    fits = runner.invoke(app, ["plan", "llama3-8b", "dp_shard=8", "--json"])
    assert fits.exit_code == 0, fits.output
    body = json.loads(fits.output)
    assert body["fits"] is True
    assert body["mesh"]["world_size"] == 8
    too_big = runner.invoke(app, ["plan", "llama3-405b", "dp_shard=8", "--sharding", "zero1"])
    assert too_big.exit_code == 1
    assert "does not fit" in too_big.output
    custom = "layers=2,hidden=256,heads=4,kv_heads=2,ffn_hidden=512,vocab=1000"
    assert runner.invoke(app, ["plan", custom, "tp=2"]).exit_code == 0
    for bad in (["llama3-7b", "tp=2"], ["llama3-8b", "tp=3"], ["layers=2", "tp=1"], ["llama3-8b", "dp=2"]):
        result = runner.invoke(app, ["plan", *bad])
        assert result.exit_code == 2, (bad, result.output)
