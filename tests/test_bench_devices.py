"""The benchmarks' ranks: one rank per GPU on CUDA, else four CPU ranks, in a layout that fits them (no GPU here: the
count of GPUs is given to the function, as ``torch.cuda.device_count()`` would give it)."""

from __future__ import annotations

import pytest
import torch

from bench.devices import bench_mesh, bench_ranks
from opsd.protocol.mesh import MeshSpec


@pytest.mark.parametrize(
    ("gpus", "ranks", "mesh"),
    [(0, 4, "dp_shard=2,tp=2"), (1, 1, ""), (2, 2, "dp_shard=2"), (4, 4, "dp_shard=2,tp=2"), (8, 8, "dp_shard=4,tp=2")],
    ids=["cpu", "one-gpu", "two-gpus", "four-gpus", "eight-gpus"],
)
def test_one_rank_per_gpu_else_four_cpu_ranks_in_a_layout_that_fits(gpus: int, ranks: int, mesh: str) -> None:
    assert bench_ranks(gpus) == ranks
    assert bench_mesh(ranks) == mesh
    assert MeshSpec.parse(mesh, ranks).world_size == ranks  # a valid layout of exactly that many ranks


def test_this_machine_without_a_gpu_runs_four_cpu_ranks() -> None:
    assert not torch.cuda.is_available()
    assert bench_ranks() == 4
