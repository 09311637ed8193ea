"""The reference model trained in a Lightning Fabric loop with opsd's monitor (docs/integrations.md): DDP on gloo
under torchrun on CPU (``torchrun --nproc-per-node 2 -m examples.fabric_loop --checkpoint-dir DIR``), or Fabric's
model-parallel strategy with the model sharded by FSDP2 over the ranks (``--strategy model_parallel``), each rank
its own shard of synthetic token sequences (seeded), one batch a step.

At the steps of the controller's cadence (``$OPSD_POLICY_FILE``) it saves ``DIR/step=N.ckpt`` with ``fabric.save``
(a distributed checkpoint, a directory, under the model-parallel strategy);
``--resume`` loads the newest and goes on from the next step; ``--kill-at-step`` SIGKILLs rank 0 after that step
(fault injection); ``--losses-out`` gets each step's loss (rank 0)."""

from __future__ import annotations

import argparse
import json
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.strategies.model_parallel import ModelParallelStrategy
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from examples.config import ModelConfig
from examples.integration_cli import NoMonitor, StepClock, common_options, launch_layout, lightning_options
from examples.model import Transformer, model_shape
from opsd.protocol.wire import CHECKPOINT
from trainer_hooks.integrations.lightning import fabric_monitor, last_checkpoint
from trainer_hooks.monitor import Monitor, MonitorConfig
from trainer_hooks.policy_reader import PolicyReader, policy_source
from trainer_hooks.process_exit import run_and_exit


def shard(model: Transformer, mesh: DeviceMesh) -> Transformer:
    """Fabric's model-parallel strategy's ``parallelize_fn``: each block, then the whole, sharded over the ranks
    (FSDP2 on the mesh's ``data_parallel`` dimension)."""
    for block in model.layers.values():
        fully_shard(block, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def strategy(name: str, world: int) -> str | ModelParallelStrategy:
    """Fabric's strategy: none for one rank; DDP; or its model-parallel one, every rank data parallel (FSDP2)."""
    if world == 1:
        return "auto"
    if name == "model_parallel":
        return ModelParallelStrategy(parallelize_fn=shard, data_parallel_size=world, tensor_parallel_size=1)
    return name


def main(argv: Sequence[str] | None = None) -> int:
    p = lightning_options(common_options(argparse.ArgumentParser(description=__doc__.splitlines()[0])), "Fabric")
    args = p.parse_args(argv)
    devices, nodes = launch_layout()
    fabric = Fabric(
        accelerator="cpu", devices=devices, num_nodes=nodes, strategy=strategy(args.strategy, devices * nodes)
    )
    fabric.launch()  # under torchrun: joins its ranks (it starts no process)
    cfg = ModelConfig(seq_len=args.seq_len)
    torch.manual_seed(0)
    plain = Transformer(cfg)
    shape = model_shape(plain)
    model = fabric.setup_module(plain)  # sharded first: the optimizer takes the sharded parameters
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert not isinstance(optimizer, tuple)  # one optimizer set up: itself
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    resume = last_checkpoint(args.checkpoint_dir) if args.resume else None
    if resume is not None:
        fabric.load(resume, state)
    generator = torch.Generator().manual_seed(fabric.global_rank)  # this rank's shard
    tokens = torch.randint(0, cfg.vocab_size, (args.steps, args.batch_size, args.seq_len + 1), generator=generator)
    jsonl = args.opsd_jsonl.replace("{rank}", str(fabric.global_rank)) if args.opsd_jsonl else None
    monitor: Monitor | NoMonitor
    if args.no_opsd:  # the framework alone: bench.hook_overhead's other side
        monitor = NoMonitor()
    else:
        monitor = fabric_monitor(fabric, model, shape=shape, config=MonitorConfig(jsonl_path=jsonl))
    clock = StepClock()
    policy = PolicyReader(policy_source())
    if state["step"]:
        monitor.resume_at(state["step"])
    losses: dict[str, float] = {}
    while state["step"] < args.steps:
        batch = tokens[state["step"]]
        clock.start()
        with monitor.step(tokens=args.batch_size * args.seq_len):
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            monitor.record_loss(loss)
        clock.stop()
        state["step"] += 1
        losses[str(state["step"])] = float(loss.detach())
        own = args.save_every > 0 and state["step"] % args.save_every == 0  # until the controller's cadence
        if policy.current().checkpoint_due(state["step"], own):
            with monitor.busy(CHECKPOINT):
                fabric.save(os.path.join(args.checkpoint_dir, f"step={state['step']}.ckpt"), state)
        if state["step"] == args.kill_at_step and resume is None and fabric.global_rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
    monitor.close()
    policy.close()
    clock.write(args.step_times_out)
    if args.losses_out and fabric.global_rank == 0:
        Path(args.losses_out).write_text(json.dumps(losses))
    return 0


if __name__ == "__main__":
    run_and_exit(main)  # the exit code main means, whatever gloo's threads do at exit (docs/crash.md)
