"""Where a benchmark's ranks run: one rank per GPU on CUDA (NCCL refuses two ranks on one GPU), else a fixed number
of CPU ranks on gloo; and the parallel layout that fits that many ranks. Every tensor a benchmark makes for its
model, its inputs or its own bookkeeping collectives goes on the device ``examples.train.init_distributed`` chose
for the rank (its GPU, else the CPU)."""

from __future__ import annotations

import torch

CPU_RANKS = 4


def bench_ranks(cuda_devices: int | None = None, cpu_ranks: int = CPU_RANKS) -> int:
    """The ranks to start: one per visible GPU, else ``cpu_ranks``."""
    count = torch.cuda.device_count() if cuda_devices is None else cuda_devices
    return count if count > 0 else cpu_ranks


def bench_mesh(ranks: int) -> str:
    """A layout for ``ranks`` that uses FSDP and, from 4 ranks, tensor parallel (the monitor's usual collectives)."""
    if ranks <= 1:
        return ""
    if ranks % 4 == 0:
        return f"dp_shard={ranks // 2},tp=2"
    return f"dp_shard={ranks}"


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (nothing to wait for on the CPU): a benchmark's own timing, never the
    monitor's."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
