"""What the reference trainer's ``--losses-out`` holds: the losses, what every rank holds (proof that each
dimension splits work or weights), and hashes of each rank's model and optimizer state, to compare runs bitwise."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from examples.config import ModelConfig
from examples.model import Transformer
from examples.parallelize import ParallelModel

if TYPE_CHECKING:
    from trainer_hooks.checkpoint import TrainState


def local_numel(module: torch.nn.Module) -> int:
    """Parameter elements held by this rank (the local shard of a DTensor)."""
    return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in module.parameters())


def state_hashes(state: TrainState) -> list[str]:
    """SHA-256 of each rank's part of the model and optimizer state (DTensors by their local shard), gathered:
    two runs with the same layout ended in the same state exactly when the lists are equal."""
    return gather_digests(state_digest(state.model, state.optimizer))


def gather_digests(mine: bytes) -> list[str]:
    """Every rank's 32-byte digest, in rank order, as hex."""
    gathered = torch.zeros(dist.get_world_size() * 32, dtype=torch.uint8)
    dist.all_gather_into_tensor(gathered, torch.tensor(list(mine), dtype=torch.uint8))
    return [bytes(row.tolist()).hex() for row in gathered.view(-1, 32)]


def state_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bytes:
    """SHA-256 of this rank's part of the model and optimizer state (DTensors by their local shard)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    digest = hashlib.sha256()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    flat: list[tuple[str, Any]] = []

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key in sorted(value, key=str):
                walk(f"{prefix}/{key}", value[key])
        else:
            flat.append((prefix, value))

    walk("model", model_sd)
    walk("optim", optim_sd)
    for key, value in flat:
        digest.update(key.encode())
        if isinstance(value, DTensor):
            value = value.to_local()
        if isinstance(value, torch.Tensor):
            digest.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(value).encode())
    return digest.digest()


def write_report(
    path: Path,
    model: ParallelModel,
    cfg: ModelConfig,
    losses: list[float],
    tokens_per_step: int,
    **extra: Any,
) -> None:
    """Rank 0 writes the losses and what every rank holds: proof that each dimension splits work or weights."""
    names = list(model.coords)
    mine = [dist.get_rank(), local_numel(model.module), model.local_tokens, *model.coords.values()]
    gathered = torch.zeros(dist.get_world_size() * len(mine), dtype=torch.int64)
    dist.all_gather_into_tensor(gathered, torch.tensor(mine, dtype=torch.int64))
    ranks = [
        {"rank": row[0], "params": row[1], "tokens_per_step": row[2], "coords": dict(zip(names, row[3:], strict=True))}
        for row in gathered.view(dist.get_world_size(), len(mine)).tolist()
    ]
    if dist.get_rank() == 0:
        full = sum(p.numel() for p in Transformer(cfg).parameters())
        report = {
            "layout": str(model.spec),
            "losses": losses,
            "full_params": full,
            "global_tokens_per_step": tokens_per_step,
            "ranks": ranks,
            **extra,
        }
        path.write_text(json.dumps(report, indent=1))
