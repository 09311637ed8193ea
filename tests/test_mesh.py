"""Parsing and validation of the reference trainer's --mesh: tables of named cases."""

from __future__ import annotations

import pytest

from opsd.protocol.mesh import LayoutLimits, MeshError, MeshSpec, validate_layout

LIMITS = LayoutLimits(n_heads=4, n_kv_heads=2, n_layers=4, n_experts=0, seq_len=32, batch_size=8, microbatches=2)
MOE = LayoutLimits(n_heads=4, n_kv_heads=2, n_layers=4, n_experts=4, seq_len=32, batch_size=8, microbatches=2)

PARSE_CASES = {
    "empty is single": ("", MeshSpec()),
    "one dimension": ("dp_shard=4", MeshSpec(dp_shard=4)),
    "all dimensions": (
        "dp_replicate=2,dp_shard=3,tp=4,pp=5,cp=6,ep=7",
        MeshSpec(dp_replicate=2, dp_shard=3, tp=4, pp=5, cp=6, ep=7),
    ),
    "spaces and trailing comma": (" pp=2 , tp=2, ", MeshSpec(pp=2, tp=2)),
}


@pytest.mark.parametrize(("text", "expected"), PARSE_CASES.values(), ids=PARSE_CASES.keys())
def test_parse(text: str, expected: MeshSpec) -> None:
    assert MeshSpec.parse(text) == expected


FILL_CASES = {
    "alone: the world": ("dp_shard=-1", 4, MeshSpec(dp_shard=4)),
    "with tp: what tp leaves": ("dp_shard=-1,tp=2", 4, MeshSpec(dp_shard=2, tp=2)),
    "shrunk to one shard": ("dp_shard=-1,tp=2", 2, MeshSpec(dp_shard=1, tp=2)),
}


@pytest.mark.parametrize(("text", "world", "expected"), FILL_CASES.values(), ids=FILL_CASES.keys())
def test_dp_shard_fills_the_world(text: str, world: int, expected: MeshSpec) -> None:
    assert MeshSpec.parse(text, world) == expected


PARSE_ERRORS = {
    "unknown dimension": ("dp=2", "unknown dimension 'dp'"),
    "missing degree": ("tp", "expected NAME=DEGREE"),
    "not an integer": ("tp=two", "degree of tp must be an integer"),
    "zero": ("tp=0", "tp must be an integer >= 1"),
    "negative": ("pp=-2", "pp must be an integer >= 1"),
    "given twice": ("tp=2,tp=2", "given twice"),
    "fill without a world": ("dp_shard=-1", "dp_shard=-1 needs a world size that is a multiple of 1, got None"),
    "-1 elsewhere": ("tp=-1", "tp must be an integer >= 1"),
}


@pytest.mark.parametrize(("text", "message"), PARSE_ERRORS.values(), ids=PARSE_ERRORS.keys())
def test_parse_rejects(text: str, message: str) -> None:
    with pytest.raises(MeshError, match=message):
        MeshSpec.parse(text)


def test_derived_sizes() -> None:
    spec = MeshSpec(dp_replicate=2, dp_shard=3, tp=4, pp=5, cp=6, ep=7)
    assert spec.world_size == 2 * 3 * 4 * 5 * 6 * 7
    assert spec.batch_shards == 2 * 3 * 7
    assert spec.fsdp_size == 7 * 3 * 6
    assert spec.data_parallel_size == 2 * 7 * 3 * 6
    assert str(MeshSpec(pp=2, tp=2)) == "pp=2,tp=2"
    assert str(MeshSpec()) == "single"


VALID = {
    "fsdp": ("dp_shard=4", 4, LIMITS),
    "hsdp": ("dp_replicate=2,dp_shard=2", 4, LIMITS),
    "tp": ("dp_shard=2,tp=2", 4, LIMITS),
    "pp": ("pp=2,dp_shard=2", 4, LIMITS),
    "cp": ("cp=2,dp_shard=2", 4, LIMITS),
    "ep": ("ep=2,dp_shard=2", 4, MOE),
    "3d": ("pp=2,tp=2,dp_shard=2", 8, LIMITS),
    "single": ("", 1, LIMITS),
    "uneven pipeline": ("pp=3", 3, LayoutLimits(4, 2, 4, 0, 32, 8, 2)),
}


@pytest.mark.parametrize(("text", "world", "limits"), VALID.values(), ids=VALID.keys())
def test_valid_layouts(text: str, world: int, limits: LayoutLimits) -> None:
    validate_layout(MeshSpec.parse(text), world, limits)


INVALID = {
    "product differs from world": ("dp_shard=2", 4, LIMITS, "must equal the world size 4"),
    "tp does not divide heads": ("tp=3", 3, LIMITS, "tp=3 must divide the attention heads"),
    "tp does not divide kv heads": ("tp=4", 4, LIMITS, "tp=4 must divide the key/value heads"),
    "pp larger than layers": ("pp=5", 5, LIMITS, "pp=5 must not exceed the layers"),
    "ep without experts": ("ep=2", 2, LIMITS, "ep=2 needs MoE layers"),
    "ep does not divide experts": ("ep=3", 3, MOE, "ep=3 must divide the experts"),
    "cp does not divide sequence": ("cp=3", 3, LayoutLimits(4, 2, 4, 0, 32, 9, 1), "cp=3 must divide the sequence"),
    "batch not divisible": ("dp_shard=3", 3, LIMITS, "must divide the global batch"),
    "microbatches do not divide": ("pp=2", 2, LayoutLimits(4, 2, 4, 0, 32, 8, 3), "microbatches=3 must divide"),
}


@pytest.mark.parametrize(("text", "world", "limits", "message"), INVALID.values(), ids=INVALID.keys())
def test_invalid_layouts(text: str, world: int, limits: LayoutLimits, message: str) -> None:
    with pytest.raises(MeshError, match=message) as info:
        validate_layout(MeshSpec.parse(text), world, limits)
    assert "\n" not in str(info.value)
