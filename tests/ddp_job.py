"""A DDP job for tests/test_monitor_ddp.py (run under torchrun): a few steps with the monitor watching DDP.

Prints, on rank 0, one JSON line: the last report, the model's parameter bytes, whether the replicas agree."""

from __future__ import annotations

import json

import msgspec
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainer_hooks import ModelShape, Monitor, MonitorConfig
from trainer_hooks.process_exit import run_and_exit


def main() -> int:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 32))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.02)  # small buckets: several all-reduces per step
    shape = ModelShape(n_layers=1, n_heads=1, head_dim=32, seq_len=8, dense_matmul_params=2 * 32 * 256)
    monitor = Monitor(shape, MonitorConfig(run_id="ddp"))
    monitor.watch_ddp(ddp)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(3):
        with monitor.step(tokens=64):
            ddp(torch.randn(64, 32)).square().mean().backward()  # each rank its own data
            optimizer.step()
            optimizer.zero_grad()
    # the replicas stay identical only if the gradients were really averaged across ranks
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    highest = flat.clone()
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        result = {
            "report": msgspec.to_builtins(monitor.last_report),
            "param_bytes": param_bytes,
            "replicas_equal": torch.equal(flat, highest),
        }
        print(json.dumps(result), flush=True)
    monitor.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_and_exit(main)  # the exit code main means, whatever gloo's threads are doing (docs/crash.md)
