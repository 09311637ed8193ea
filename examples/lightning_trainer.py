"""The reference model trained by Lightning's ``Trainer`` with opsd's callback (docs/integrations.md): DDP on gloo
under torchrun on CPU (``torchrun --nproc-per-node 2 -m examples.lightning_trainer --checkpoint-dir DIR``), or
Lightning's model-parallel strategy with the model sharded by FSDP2 (``--strategy model_parallel``), synthetic token
sequences of a fixed seed, one epoch of ``--steps`` steps.

With ``--resume`` it resumes from the newest checkpoint the callback saved in ``--checkpoint-dir``; ``--kill-at-step``
SIGKILLs rank 0 after that step (a save due at it written first: fault injection); ``--losses-out`` gets each
optimizer step's loss (rank 0). The opsd side is ``trainer_hooks.integrations.lightning`` and three lines below."""

from __future__ import annotations

import argparse
import json
import os
import signal
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

from examples.config import ModelConfig
from examples.integration_cli import StepClock, common_options, launch_layout, lightning_options
from examples.model import Transformer, model_shape
from trainer_hooks.integrations.lightning import OpsdCallback, last_checkpoint
from trainer_hooks.monitor import MonitorConfig
from trainer_hooks.process_exit import run_and_exit


class TokenData(torch.utils.data.Dataset[torch.Tensor]):
    """``size`` sequences of ``seq_len + 1`` random tokens (seeded): inputs and next-token targets."""

    def __init__(self, size: int, seq_len: int, vocab: int, seed: int = 0) -> None:
        self.tokens = torch.randint(0, vocab, (size, seq_len + 1), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.tokens[index]


class FromStep(torch.utils.data.Sampler[int]):
    """The indices of a rank's shard in order, from ``start``: a run resumed mid-epoch goes on with the batch after
    its checkpoint's (Lightning restores the step, not a plain loader's position)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.start = 0

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.size))

    def __len__(self) -> int:
        return self.size  # the epoch's length: the resumed loop counts the batches done already


class LanguageModel(pl.LightningModule):
    def __init__(self, cfg: ModelConfig, sampler: FromStep, batch_size: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Transformer(cfg)
        self.sampler, self.batch_size = sampler, batch_size
        self.losses: dict[int, float] = {}
        self.sharded = False  # by configure_model, once

    def on_train_start(self) -> None:
        self.sampler.start = self.trainer.global_step * self.batch_size  # 0, or the step resumed from

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        self.losses[self.trainer.global_step + 1] = float(loss.detach())  # the optimizer step it is part of
        return loss

    def configure_model(self) -> None:
        """Under Lightning's model-parallel strategy: each block, then the whole, sharded over the ranks (FSDP2)."""
        mesh = self.device_mesh
        if mesh is None or self.sharded:
            return
        for block in self.model.layers.values():
            fully_shard(block, mesh=mesh["data_parallel"])
        fully_shard(self.model, mesh=mesh["data_parallel"])
        self.sharded = True

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class KillAt(pl.Callback):
    """Fault injection: rank 0 is SIGKILLed once step ``step`` is done (opsd's save due at it written first: it is
    the callback before this one)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and trainer.global_rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)


class StartStep(pl.Callback):
    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def on_train_batch_start(self, *args: Any) -> None:
        self.clock.start()


class EndStep(StartStep):
    def on_train_batch_start(self, *args: Any) -> None:
        pass

    def on_train_batch_end(self, *args: Any) -> None:
        self.clock.stop()


def strategy(name: str, world: int) -> str | ModelParallelStrategy:
    """Lightning's strategy: none for one rank; DDP; or its model-parallel one, every rank data parallel (FSDP2)."""
    if world == 1:
        return "auto"
    if name == "model_parallel":
        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    return name


def main(argv: Sequence[str] | None = None) -> int:
    p = lightning_options(common_options(argparse.ArgumentParser(description=__doc__.splitlines()[0])), "Lightning")
    args = p.parse_args(argv)
    cfg = ModelConfig(seq_len=args.seq_len)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    devices, nodes = launch_layout()
    shard = TokenData(args.steps * args.batch_size, args.seq_len, cfg.vocab_size, seed=rank)  # this rank's
    sampler = FromStep(len(shard))
    module = LanguageModel(cfg, sampler, args.batch_size)
    data = torch.utils.data.DataLoader(shard, batch_size=args.batch_size, sampler=sampler)
    jsonl = args.opsd_jsonl.replace("{rank}", str(rank)) if args.opsd_jsonl else None
    opsd = OpsdCallback(
        seq_len=args.seq_len,
        checkpoint_dir=args.checkpoint_dir,
        every_steps=args.save_every,
        shape=model_shape(module.model),
        config=MonitorConfig(jsonl_path=jsonl),
    )
    resume = last_checkpoint(args.checkpoint_dir) if args.resume else None  # a relaunch that resumes is not killed
    clock = StepClock()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=nodes,
        strategy=strategy(args.strategy, world),
        max_epochs=1,
        callbacks=[
            StartStep(clock),  # each step's time, for bench.hook_overhead: started before opsd's callback
            *([] if args.no_opsd else [opsd]),  # the framework alone: the benchmark's other side
            EndStep(clock),
            *([KillAt(args.kill_at_step)] if args.kill_at_step and resume is None else []),
        ],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        deterministic=True,
        use_distributed_sampler=False,  # each rank reads its own shard, from the step it resumed at (FromStep)
    )
    trainer.fit(module, data, ckpt_path=resume)
    clock.write(args.step_times_out)
    if args.losses_out and rank == 0:
        Path(args.losses_out).write_text(json.dumps({str(s): v for s, v in sorted(module.losses.items())}))
    return 0


if __name__ == "__main__":
    run_and_exit(main)  # the exit code main means, whatever gloo's threads do at exit (docs/crash.md)
