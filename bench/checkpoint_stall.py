"""How long an asynchronous checkpoint stops training, and how much training it costs while it writes, against a
synchronous one: ``python -m bench.checkpoint_stall``.

One rank per GPU on CUDA (NCCL), else 4 CPU ranks (gloo), in ``dp_shard`` over all of them, hold a reference model
with its AdamW state (about 800 MB in all at the default size). In one job, four kinds of save take turns (the
order rotates every round): ``dcp``, a plain synchronous ``torch.distributed.checkpoint.save`` of the same state
(no checksums, no manifest: the baseline without opsd); ``sync``, opsd's synchronous save (training stopped until
every shard is written, hashed and committed); and opsd's asynchronous save (stopped only while the state is staged
in memory), which writes on a thread of the rank (``thread``) or in a helper process per rank (``process``). After
each save, training steps run while the write is in flight on any rank (up to ``--max-steps``), then one after it
finished. The training time lost to a background write is, over the steps that ran during it, the sum of their
excess over the median step with no write in flight: what the blocking time does not show (a writer that shares
the training process's interpreter slows its steps down). Each step's time is the slowest rank's, the device
drained at its end. Printed: the median blocking and staging seconds of each kind, the write rate, the steps, and
per async writer the median training time lost per save and the writer that loses the least.

Every save of opsd's must be committed: after each one, its manifest is read back and checked (valid, each file at
its listed size, shards of every rank and DCP's ``.metadata`` listed, as many bytes as the ranks wrote). A save with
no manifest or a short one fails the benchmark (exit 1, the save named on stderr) and no ratio is printed.

Figures, one ``name=value`` line each: ``checkpoint_lost_training_s_thread``, ``checkpoint_lost_training_s_process``,
``checkpoint_sync_vs_dcp_ratio`` (opsd's sync save over plain DCP's: the cost of hashing and committing),
``checkpoint_blocking_ratio`` (median async (thread) blocking / median opsd sync blocking), and last
``checkpoint_blocking_vs_dcp_ratio`` (median async (thread) blocking / median plain DCP save).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
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
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from bench.devices import bench_ranks, synchronize
from examples.config import ModelConfig
from examples.model import Transformer
from examples.parallelize import build_mesh, lm_loss, parallelize
from examples.train import init_distributed
from opsd.checkpoints.layout import CheckpointStore, inspect_checkpoints
from opsd.checkpoints.store import open_store
from opsd.protocol.manifest import parse_manifest
from opsd.protocol.mesh import MeshSpec
from trainer_hooks.checkpoint import CheckpointConfig, Checkpointer, TrainState
from trainer_hooks.checkpoint_io import DCP_METADATA

KINDS = ("dcp", "sync", "thread", "process")
OPSD_KINDS = ("sync", "thread", "process")  # opsd's saves: each commits a manifest
ASYNC_KINDS = ("thread", "process")  # opsd's saves that write in the background
SHARD = re.compile(r"^__(\d+)_")  # DCP's file of a rank: __<rank>_<n>.distcp


class Saved:
    """What ``on_saved`` reported on this rank, by step: (bytes written, staging seconds)."""

    def __init__(self) -> None:
        self.by_step: dict[int, tuple[int, float]] = {}

    def __call__(self, **saved: Any) -> None:
        self.by_step[saved["step"]] = (saved["nbytes"], saved["staging_s"])

    def staging_s(self) -> list[float]:
        """Each save's staging seconds, oldest first."""
        return [self.by_step[step][1] for step in sorted(self.by_step)]


def manifest_problem(store: CheckpointStore, step: int, world_size: int, nbytes: int) -> str | None:
    """What is wrong with the commit of ``step`` in ``store``; None for a valid manifest, each file at its listed
    size, shards of every rank and DCP's ``.metadata`` listed, ``nbytes`` in all (what the ranks said they wrote)."""
    found = {c.step: c for c in inspect_checkpoints(store)}
    if step not in found:
        return "no checkpoint directory"
    if found[step].problem is not None:
        return str(found[step].problem)
    data = store.read_manifest(step)
    assert data is not None  # inspect_checkpoints found it committed
    manifest = parse_manifest(data)
    paths = {f.path for f in manifest.files}
    ranks = {int(m.group(1)) for path in paths if (m := SHARD.match(path))}
    if missing := sorted(set(range(world_size)) - ranks):
        return f"the manifest lists no shard of rank(s) {missing}"
    if DCP_METADATA not in paths:
        return f"the manifest does not list {DCP_METADATA}"
    if manifest.total_bytes != nbytes:
        return f"the manifest lists {manifest.total_bytes} bytes, the ranks wrote {nbytes}"
    return None


def slowest(seconds: float, device: torch.device) -> float:
    value = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def any_rank(flag: bool, device: torch.device) -> bool:
    value = torch.tensor(int(flag), dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(int(value))


def lost_s(during: list[float], idle_s: float) -> float:
    """The training time a write cost: the excess of the steps that ran during it over a step with no write."""
    return sum(max(step_s - idle_s, 0.0) for step_s in during)


def worker(root: Path, dim: int, layers: int, rounds: int, max_steps: int) -> int:
    device = init_distributed()
    ranks = dist.get_world_size()
    spec = MeshSpec.parse(f"dp_shard={ranks}" if ranks > 1 else "", ranks)
    cfg = ModelConfig(
        vocab_size=1024, dim=dim, n_layers=layers, n_heads=8, n_kv_heads=8, ffn_hidden=4 * dim, seq_len=16
    )
    meshes = build_mesh(spec, device.type)
    model = parallelize(lambda: Transformer(cfg), spec, meshes, device, microbatches=1)
    optimizer = torch.optim.AdamW(model.module.parameters(), lr=1e-4, foreach=device.type == "cuda")
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len + 1), device=device)

    def train_step() -> float:
        synchronize(device)
        start = time.perf_counter()
        lm_loss(model.module(tokens[:, :-1]), tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
        synchronize(device)
        return time.perf_counter() - start

    train_step()  # the optimizer state exists: a real checkpoint's size
    state = TrainState(model.module, optimizer)
    rank, world = dist.get_rank(), dist.get_world_size()
    saved = {kind: Saved() for kind in OPSD_KINDS}
    savers = {
        kind: Checkpointer(
            CheckpointConfig(
                str(root / kind),
                keep_last=1,
                async_save=kind != "sync",
                async_mode="process" if kind == "process" else "thread",
                when_busy="wait",
            ),
            on_saved=saved[kind],
        )
        for kind in OPSD_KINDS
    }
    stores = {kind: open_store(str(root / kind)) for kind in OPSD_KINDS}

    def plain_save(step: int) -> float:
        """The baseline: DCP's synchronous save of the same state, with nothing of opsd's around it."""
        start = time.perf_counter()
        dcp_save(state.state_dict(rank), checkpoint_id=str(root / "dcp" / f"step_{step:09d}"))
        return time.perf_counter() - start

    blocking: dict[str, list[float]] = {kind: [] for kind in KINDS}
    writing_steps: dict[str, list[list[float]]] = {kind: [] for kind in ASYNC_KINDS}  # per save, its steps
    idle_step: list[float] = []
    problems: list[str] = []
    commits = step = 0
    for r in range(rounds + 1):  # round 0 warms up (the process kind starts its helpers then); not counted
        for i in range(len(KINDS)):
            kind = KINDS[(i + r) % len(KINDS)]
            step += 1
            if rank == 0:  # one plain checkpoint on disk at a time, as opsd's keep_last=1
                shutil.rmtree(root / "dcp", ignore_errors=True)
            dist.barrier()
            seconds = slowest(plain_save(step) if kind == "dcp" else savers[kind].save(step, state), device)
            during: list[float] = []
            if kind in ASYNC_KINDS:  # train while the write is in flight on any rank
                while len(during) < max_steps and any_rank(savers[kind].writing(), device):
                    during.append(slowest(train_step(), device))
                savers[kind].wait()
            after = slowest(train_step(), device)
            if r > 0:
                blocking[kind].append(seconds)
                idle_step.append(after)
                if kind in ASYNC_KINDS:
                    writing_steps[kind].append(during)
            if kind == "dcp":
                continue
            # once wait() returned everywhere, rank 0 has written the manifest and every rank said what it wrote
            written = torch.tensor(saved[kind].by_step.get(step, (0, 0.0))[0], dtype=torch.int64, device=device)
            dist.all_reduce(written)
            if rank == 0:
                problem = manifest_problem(stores[kind], step, world, int(written))
                if problem is None:
                    commits += 1
                else:
                    problems.append(f"{kind} save of step {step}: {problem}")
    for saver in savers.values():
        saver.close()
    # the first save of a kind allocates its staging buffer: not counted
    staging = {
        kind: slowest(statistics.median([0.0, *saved[kind].staging_s()][-rounds:]), device) for kind in OPSD_KINDS
    }
    biggest = max((n for kind in OPSD_KINDS for n, _ in saved[kind].by_step.values()), default=0)
    total = torch.tensor(biggest, dtype=torch.int64, device=device)
    dist.all_reduce(total)
    if rank == 0:
        saves = (rounds + 1) * len(OPSD_KINDS)
        print(f"commits: {commits} of {saves} opsd saves have a complete manifest (every rank's shards, full size)")
        for problem in problems:
            print(f"not committed: {problem}", file=sys.stderr, flush=True)
    if rank == 0 and not problems:
        med = {kind: statistics.median(blocking[kind]) for kind in KINDS}
        params = sum(p.numel() for p in Transformer(cfg).parameters())
        size_mb = int(total) / 1e6
        where = f"{device.type} x {world} rank(s)"
        print(f"model {params / 1e6:.1f} M parameters; checkpoint {size_mb:.0f} MB over {where}")
        print(f"plain DCP save: median {med['dcp']:.3f} s blocking ({size_mb / med['dcp']:.0f} MB/s written)")
        print(f"opsd sync save: median {med['sync']:.3f} s blocking ({size_mb / med['sync']:.0f} MB/s written)")
        for kind in ASYNC_KINDS:
            print(f"async save ({kind}): median {med[kind]:.3f} s blocking, of which {staging[kind]:.3f} s staging")
        idle = statistics.median(idle_step)
        lost = {kind: statistics.median([lost_s(d, idle) for d in writing_steps[kind]]) for kind in ASYNC_KINDS}
        for kind in ASYNC_KINDS:
            steps = [s for d in writing_steps[kind] for s in d]
            mean = statistics.mean(steps) if steps else idle
            print(
                f"training during an async write ({kind}): {len(steps) / max(rounds, 1):.1f} steps a save, "
                f"{mean:.3f} s each against {idle:.3f} s with no write: {lost[kind]:.3f} s of training lost a save"
            )
        print(f"writer losing the least training: {min(ASYNC_KINDS, key=lambda k: lost[k])} (on {device.type})")
        for kind in KINDS:
            print(f"checkpoint_blocking_s_{kind}={med[kind]:.4f}")
        for kind in ASYNC_KINDS:
            print(f"checkpoint_lost_training_s_{kind}={lost[kind]:.4f}")
        print(f"checkpoint_sync_vs_dcp_ratio={med['sync'] / med['dcp']:.4f}")
        print(f"checkpoint_blocking_ratio={med['thread'] / med['sync']:.4f}")
        print(f"checkpoint_blocking_vs_dcp_ratio={med['thread'] / med['dcp']:.4f}", flush=True)
    failed = torch.tensor(len(problems), dtype=torch.int64, device=device)
    dist.all_reduce(failed)  # every rank exits with the verdict
    dist.barrier()
    dist.destroy_process_group()
    return 1 if int(failed) else 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.checkpoint_stall", description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="saves of each kind (after one round of warm-up)")
    p.add_argument("--max-steps", type=int, default=200, help="training steps at most while one write is in flight")
    p.add_argument("--ranks", type=int, help="ranks to start (default: one per GPU, else 4 on the CPU)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dim < 8 or args.dim % 8 or args.layers < 1 or args.rounds < 1 or args.max_steps < 1:
        p.error("--dim must be a multiple of 8 (8 heads), --layers, --rounds and --max-steps >= 1")
    if args.worker:
        return worker(Path(args.worker), args.dim, args.layers, args.rounds, args.max_steps)
    ranks = args.ranks or bench_ranks()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        cmd += ["-m", "bench.checkpoint_stall", "--worker", tmp, "--dim", str(args.dim), "--layers", str(args.layers)]
        cmd += ["--rounds", str(args.rounds), "--max-steps", str(args.max_steps)]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    print("\n".join(line for line in proc.stdout.splitlines() if line.strip()), flush=True)
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
        print("bench.checkpoint_stall failed: a save was not committed, or a rank failed (above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
