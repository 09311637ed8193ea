"""How long an asynchronous checkpoint stops training, against a synchronous one: ``python -m bench.checkpoint_stall``.

4 CPU ranks (``dp_shard=4``) hold a reference model with its AdamW state (about 800 MB in all at the default
size). In one job, saves alternate A B B A ...: a synchronous save (training stopped until every shard is written)
and an asynchronous one (stopped only while the state is staged in memory; written in the background, waited for
before the next save). A save's time is the slowest rank's. Printed: the median blocking seconds of each, the
bytes written and the synchronous write rate.

Last line: ``checkpoint_blocking_ratio=<median async blocking / median sync blocking>``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from bench.hook_overhead import is_a
from examples.mesh import MeshSpec
from examples.model import ModelConfig, Transformer
from examples.parallelize import build_mesh, lm_loss, parallelize
from examples.train import init_distributed
from trainer_hooks.checkpoint import CheckpointConfig, Checkpointer, TrainState

RANKS = 4


def worker(root: Path, dim: int, layers: int, pairs: int) -> None:
    device = init_distributed()
    spec = MeshSpec.parse(f"dp_shard={RANKS}")
    cfg = ModelConfig(
        vocab_size=1024, dim=dim, n_layers=layers, n_heads=8, n_kv_heads=8, ffn_hidden=4 * dim, seq_len=16
    )
    meshes = build_mesh(spec, device.type)
    model = parallelize(lambda: Transformer(cfg), spec, meshes, device, microbatches=1)
    optimizer = torch.optim.AdamW(model.module.parameters(), lr=1e-4, foreach=False)
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len + 1))
    lm_loss(model.module(tokens[:, :-1]), tokens[:, 1:]).backward()
    optimizer.step()  # the optimizer state exists: a real checkpoint's size
    state = TrainState(model.module, optimizer)
    sizes: list[int] = []
    savers = {
        sync: Checkpointer(
            CheckpointConfig(str(root / ("sync" if sync else "async")), keep_last=1, async_save=not sync),
            on_saved=lambda step, blocking, total, nbytes: sizes.append(nbytes),
        )
        for sync in (True, False)
    }
    blocking: dict[bool, list[float]] = {True: [], False: []}
    for i in range(2 * pairs):
        sync = is_a(i)
        dist.barrier()
        seconds = torch.tensor(savers[sync].save(i + 1, state), dtype=torch.float64)
        savers[sync].wait()  # the write finishes before the next save: one save in flight at a time
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        blocking[sync].append(float(seconds))
    total = torch.tensor(max(sizes), dtype=torch.int64)
    dist.all_reduce(total)
    if dist.get_rank() == 0:
        sync_s, async_s = statistics.median(blocking[True]), statistics.median(blocking[False])
        params = sum(p.numel() for p in Transformer(cfg).parameters())
        print(f"model {params / 1e6:.1f} M parameters; checkpoint {int(total) / 1e6:.0f} MB over {RANKS} ranks")
        print(f"sync save: median {sync_s:.3f} s blocking ({int(total) / sync_s / 1e6:.0f} MB/s written)")
        print(f"async save: median {async_s:.3f} s blocking")
        print(f"checkpoint_blocking_ratio={async_s / sync_s:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.checkpoint_stall", description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--pairs", type=int, default=3, help="saves of each kind")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(Path(args.worker), args.dim, args.layers, args.pairs)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}"]
        cmd += ["-m", "bench.checkpoint_stall", "--worker", tmp, "--dim", str(args.dim), "--layers", str(args.layers)]
        cmd += ["--pairs", str(args.pairs)]
        proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
        return proc.returncode
    print("\n".join(line for line in proc.stdout.splitlines() if line.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
