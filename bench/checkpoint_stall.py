"""How long an asynchronous checkpoint stops training, against a synchronous one: ``python -m bench.checkpoint_stall``.

4 CPU ranks (``dp_shard=4``) hold a reference model with its AdamW state (about 800 MB in all at the default
size). In one job, four kinds of save take turns (the order rotates every round): ``dcp``, a plain synchronous
``torch.distributed.checkpoint.save`` of the same state (no checksums, no manifest: the baseline without opsd);
``sync``, opsd's synchronous save (training stopped until every shard is written, hashed and committed); and opsd's
asynchronous save (stopped only while the state is staged in memory), which writes on a thread of the rank
(``thread``) or in a helper process per rank (``process``). After each save, one training step runs while the write
is still going, and one after it finished: the difference is what the background write costs training. A save's
time is the slowest rank's. Printed: the median blocking and staging seconds of each kind, the write rate, the step
times, and the async blocking time over opsd's sync save and over the plain DCP save.

Every save of opsd's must be committed: after each one, its manifest is read back and checked (valid, each file at
its listed size, shards of every rank and DCP's ``.metadata`` listed, as many bytes as the ranks wrote). A save with
no manifest or a short one fails the benchmark (exit 1, the save named on stderr) and no ratio is printed.

Last lines: ``checkpoint_blocking_ratio=<median async (thread) blocking / median opsd sync blocking>``, then
``checkpoint_blocking_vs_dcp_ratio=<median async (thread) blocking / median plain DCP save>``.
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

RANKS = 4

KINDS = ("dcp", "sync", "thread", "process")
OPSD_KINDS = ("sync", "thread", "process")  # opsd's saves: each commits a manifest
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


def slowest(seconds: float) -> float:
    value = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def worker(root: Path, dim: int, layers: int, rounds: int) -> int:
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
    rank, world = dist.get_rank(), dist.get_world_size()
    saved = {kind: Saved() for kind in OPSD_KINDS}
    savers = {
        kind: Checkpointer(
            CheckpointConfig(
                str(root / kind),
                keep_last=1,
                async_save=kind != "sync",
                async_mode="process" if kind == "process" else "thread",
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
    writing_step: dict[str, list[float]] = {kind: [] for kind in KINDS}
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
            seconds = slowest(plain_save(step) if kind == "dcp" else savers[kind].save(step, state))
            during = slowest(train_step())  # the write is in flight (async kinds)
            if kind != "dcp":
                savers[kind].wait()
            after = slowest(train_step())
            if r > 0:
                blocking[kind].append(seconds)
                writing_step[kind].append(during)
                idle_step.append(after)
            if kind == "dcp":
                continue
            # once wait() returned everywhere, rank 0 has written the manifest and every rank said what it wrote
            written = torch.tensor(saved[kind].by_step.get(step, (0, 0.0))[0], dtype=torch.int64)
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
    staging = {kind: slowest(statistics.median([0.0, *saved[kind].staging_s()][-rounds:])) for kind in OPSD_KINDS}
    biggest = max((n for kind in OPSD_KINDS for n, _ in saved[kind].by_step.values()), default=0)
    total = torch.tensor(biggest, dtype=torch.int64)
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
        print(f"model {params / 1e6:.1f} M parameters; checkpoint {size_mb:.0f} MB over {RANKS} ranks")
        print(f"plain DCP save: median {med['dcp']:.3f} s blocking ({size_mb / med['dcp']:.0f} MB/s written)")
        print(f"opsd sync save: median {med['sync']:.3f} s blocking ({size_mb / med['sync']:.0f} MB/s written)")
        for kind in ("thread", "process"):
            print(f"async save ({kind}): median {med[kind]:.3f} s blocking, of which {staging[kind]:.3f} s staging")
        idle = statistics.median(idle_step)
        text = ", ".join(f"{k} {statistics.median(writing_step[k]):.3f} s" for k in ("thread", "process"))
        print(f"training step: {idle:.3f} s with no write in flight; during an async write: {text}")
        print(f"checkpoint_blocking_ratio={med['thread'] / med['sync']:.4f}")
        print(f"checkpoint_blocking_vs_dcp_ratio={med['thread'] / med['dcp']:.4f}", flush=True)
    failed = torch.tensor(len(problems), dtype=torch.int64)
    dist.all_reduce(failed)  # every rank exits with the verdict
    dist.barrier()
    dist.destroy_process_group()
    return 1 if int(failed) else 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.checkpoint_stall", description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="saves of each kind (after one round of warm-up)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dim < 8 or args.dim % 8 or args.layers < 1 or args.rounds < 1:
        p.error("--dim must be a multiple of 8 (8 heads), --layers and --rounds >= 1")
    if args.worker:
        return worker(Path(args.worker), args.dim, args.layers, args.rounds)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}"]
        cmd += ["-m", "bench.checkpoint_stall", "--worker", tmp, "--dim", str(args.dim), "--layers", str(args.layers)]
        cmd += ["--rounds", str(args.rounds)]
        proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    print("\n".join(line for line in proc.stdout.splitlines() if line.strip()), flush=True)
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
        print("bench.checkpoint_stall failed: a save was not committed, or a rank failed (above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
