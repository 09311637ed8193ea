"""``trainer_hooks.ddp.trace_buckets`` on gloo: each bucket's all-reduce starts once the one before it is done (two
collectives in flight on one gloo group can corrupt the heap: docs/crash.md)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket
from torch.nn.parallel import DistributedDataParallel

from trainer_hooks import ddp

HELD_S = 0.1  # each all-reduce is done this long after it starts


def test_on_gloo_each_bucket_waits_for_the_one_before(gloo_world: None, monkeypatch: pytest.MonkeyPatch) -> None:
    before_done: list[bool] = []  # per bucket: whether every all-reduce before it was done when it started
    futures: list[torch.futures.Future[torch.Tensor]] = []

    def held_allreduce(group: dist.ProcessGroup, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        before_done.append(all(f.done() for f in futures))
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        threading.Timer(HELD_S, future.set_result, [bucket.buffer()]).start()
        futures.append(future)
        return future

    monkeypatch.setattr(ddp, "allreduce_hook", held_allreduce)
    layers = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    model = DistributedDataParallel(layers, bucket_cap_mb=0.01)  # 16 kB weights: a bucket each
    ddp.trace_buckets(model)
    for _ in range(3):  # DDP puts everything in its first bucket (1 MB) until its second step
        model(torch.randn(8, 64)).sum().backward()
    assert len(before_done) >= 1 + 2 * 4
    assert all(before_done), before_done
