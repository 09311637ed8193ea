"""How long an asynchronous checkpoint stops training, against a synchronous one: ``python -m bench.checkpoint_stall``.

4 CPU ranks (``dp_shard=4``) hold a reference model with its AdamW state (about 800 MB in all at the default
size). In one job, three kinds of save take turns (sync, thread, process; the order rotates every round): a
synchronous save (training stopped until every shard is written and committed), and an asynchronous one (stopped
only while the state is staged in memory) that writes on a thread of the rank or in a helper process per rank.
After each save, one training step runs while the write is still going, and one after it finished: the
difference is what the background write costs training. A save's time is the slowest rank's. Printed: the median
blocking and staging seconds of each kind, the write rate, the step times.

Last line: ``checkpoint_blocking_ratio=<median async (thread) blocking / median sync blocking>``.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from examples.config import ModelConfig
from examples.model import Transformer
from examples.parallelize import build_mesh, lm_loss, parallelize
from examples.train import init_distributed
from opsd.protocol.mesh import MeshSpec
from trainer_hooks.checkpoint import CheckpointConfig, Checkpointer, TrainState

RANKS = 4


KINDS = ("sync", "thread", "process")


def record(sizes: list[int], staged: list[float], **saved: Any) -> None:
    sizes.append(saved["nbytes"])
    staged.append(saved["staging_s"])


def slowest(seconds: float) -> float:
    value = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def worker(root: Path, dim: int, layers: int, rounds: int) -> None:
    device = init_distributed()
    spec = MeshSpec.parse(f"dp_shard={RANKS}")
    cfg = ModelConfig(
        vocab_size=1024, dim=dim, n_layers=layers, n_heads=8, n_kv_heads=8, ffn_hidden=4 * dim, seq_len=16
    )
    meshes = build_mesh(spec, device.type)
    model = parallelize(lambda: Transformer(cfg), spec, meshes, device, microbatches=1)
    optimizer = torch.optim.AdamW(model.module.parameters(), lr=1e-4, foreach=False)
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len + 1))

    def train_step() -> float:
        start = time.perf_counter()
        lm_loss(model.module(tokens[:, :-1]), tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    train_step()  # the optimizer state exists: a real checkpoint's size
    state = TrainState(model.module, optimizer)
    sizes: list[int] = []
    staged: dict[str, list[float]] = {kind: [] for kind in KINDS}
    savers = {
        kind: Checkpointer(
            CheckpointConfig(
                str(root / kind),
                keep_last=1,
                async_save=kind != "sync",
                async_mode="process" if kind == "process" else "thread",
            ),
            on_saved=functools.partial(record, sizes, staged[kind]),
        )
        for kind in KINDS
    }
    blocking: dict[str, list[float]] = {kind: [] for kind in KINDS}
    writing_step: dict[str, list[float]] = {kind: [] for kind in KINDS}
    idle_step: list[float] = []
    step = 0
    for r in range(rounds + 1):  # round 0 warms up (the process kind starts its helpers then); not counted
        for i in range(len(KINDS)):
            kind = KINDS[(i + r) % len(KINDS)]
            step += 1
            dist.barrier()
            seconds = slowest(savers[kind].save(step, state))
            during = slowest(train_step())  # the write is in flight (async kinds)
            savers[kind].wait()
            after = slowest(train_step())
            if r > 0:
                blocking[kind].append(seconds)
                writing_step[kind].append(during)
                idle_step.append(after)
    for saver in savers.values():
        saver.close()
    total = torch.tensor(max(sizes), dtype=torch.int64)
    dist.all_reduce(total)
    staging = {kind: slowest(statistics.median(staged[kind][1:])) for kind in KINDS}
    if dist.get_rank() == 0:
        med = {kind: statistics.median(blocking[kind]) for kind in KINDS}
        params = sum(p.numel() for p in Transformer(cfg).parameters())
        print(f"model {params / 1e6:.1f} M parameters; checkpoint {int(total) / 1e6:.0f} MB over {RANKS} ranks")
        print(f"sync save: median {med['sync']:.3f} s blocking ({int(total) / med['sync'] / 1e6:.0f} MB/s written)")
        for kind in ("thread", "process"):
            print(f"async save ({kind}): median {med[kind]:.3f} s blocking, of which {staging[kind]:.3f} s staging")
        idle = statistics.median(idle_step)
        text = ", ".join(f"{k} {statistics.median(writing_step[k]):.3f} s" for k in ("thread", "process"))
        print(f"training step: {idle:.3f} s with no write in flight; during an async write: {text}")
        print(f"checkpoint_blocking_ratio={med['thread'] / med['sync']:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.checkpoint_stall", description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="saves of each kind (after one round of warm-up)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(Path(args.worker), args.dim, args.layers, args.rounds)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}"]
        cmd += ["-m", "bench.checkpoint_stall", "--worker", tmp, "--dim", str(args.dim), "--layers", str(args.layers)]
        cmd += ["--rounds", str(args.rounds)]
        proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
        return proc.returncode
    print("\n".join(line for line in proc.stdout.splitlines() if line.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
