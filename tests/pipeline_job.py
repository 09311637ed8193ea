"""Pipeline runs for tests/test_pipeline_bubble.py (under torchrun): the reference trainer's model, pipeline split
and schedules (``examples.parallelize``) with the opsd monitor, one configuration after another in one launch.

Each stage's forward and backward of a micro-batch take a fixed time (a sleep, on top of the tiny model's compute:
the stages are even, and ranks sharing two cores do not slow each other), and one stage may be slowed on purpose.
Argument: a JSON list of configurations ``{"schedule", "microbatches", "slow_stage", "slow_factor"}``; every rank
takes part in each (pp = world size). Prints, on rank 0, one JSON line: per configuration, per rank, the
``pipeline`` part and ``step_s`` of each measured step's report (the first step is a warm-up, not reported)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from examples.config import ModelConfig
from examples.model import Transformer
from examples.parallelize import build_mesh, parallelize
from opsd.protocol.mesh import MeshSpec
from trainer_hooks import Monitor, MonitorConfig
from trainer_hooks.process_exit import run_and_exit

FORWARD_S, BACKWARD_S = 0.040, 0.080  # per micro-batch and stage (long beside the host's jitter in waking a rank)
STEPS, WARMUP = 6, 1
BATCH = 8


class Delay(torch.autograd.Function):
    """Identity that takes ``forward_s`` in forward and ``backward_s`` in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


def run(config: dict[str, Any], cfg: ModelConfig, pp: int) -> list[dict[str, Any]]:
    spec = MeshSpec(pp=pp)
    meshes = build_mesh(spec, "cpu")
    torch.manual_seed(0)
    model = parallelize(
        lambda: Transformer(cfg),
        spec,
        meshes,
        torch.device("cpu"),
        microbatches=config["microbatches"],
        schedule=config["schedule"],
    )
    stage = model.coords["pp"]
    factor = config.get("slow_factor", 1.0) if stage == config.get("slow_stage", -1) else 1.0
    model.module.register_forward_hook(
        lambda _module, _args, out: Delay.apply(out, FORWARD_S * factor, BACKWARD_S * factor)
    )
    monitor = Monitor.from_mesh(meshes.world, None, MonitorConfig(run_id="bubble"))
    monitor.watch_pipeline(config["schedule"], stages=pp, microbatches=config["microbatches"])
    optimizer = torch.optim.SGD(model.module.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(0)
    measured = []
    for step in range(STEPS):
        tokens = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len + 1), generator=generator)
        with monitor.step(tokens=BATCH * cfg.seq_len):
            model.forward_backward(tokens[:, :-1], tokens[:, 1:])
            with monitor.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        report = monitor.last_report
        if step >= WARMUP and report is not None:
            pipeline = msgspec.to_builtins(report.pipeline) if report.pipeline is not None else None
            measured.append({"step_s": report.step_s, "pipeline": pipeline})
    monitor.close()
    dist.barrier()
    return measured


def main() -> int:
    configs = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    pp = dist.get_world_size()
    cfg = ModelConfig(vocab_size=64, dim=16, n_layers=pp, n_heads=2, n_kv_heads=1, ffn_hidden=32, seq_len=8)
    results = []
    for config in configs:
        mine = run(config, cfg, pp)
        everyone: list[Any] = [None] * pp
        dist.all_gather_object(everyone, mine)
        results.append({"config": config, "ranks": everyone})
    if dist.get_rank() == 0:
        print(json.dumps(results), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_and_exit(main)  # the exit code main means, whatever gloo's threads are doing (docs/crash.md)
