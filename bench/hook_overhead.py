"""What the opsd monitor costs a training step: ``python -m bench.hook_overhead``.

Runs the reference trainer on 4 CPU ranks (``dp_shard=2,tp=2``) in one job and alternates, step by step, steps
with the monitor (collective tracer installed, one report per step sent to a live Unix datagram socket) and steps
without it, in the order A B B A A B B A ... so that neither side always runs first. Every step starts at a
barrier; a step's time is the slowest rank's. The figure is the median, over adjacent pairs of steps (one with
the monitor, one without), of their ratio: pairing cancels the slow drifts of a shared machine. The ratio of the
median step times is printed too.

With ``--profile``, rank 0 also runs cProfile over the monitored steps and prints where the monitor's own time
goes (trainer_hooks functions by total time). Last line: ``hook_overhead_ratio=<ratio>``.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from examples.data import TokenSource, TokenSourceConfig
from examples.model import Transformer
from examples.parallelize import build_mesh, parallelize
from examples.train import check_layout, init_distributed, local_batch, make_monitor, parse_args
from opsd.protocol.env import AGENT_SOCKET_ENV
from trainer_hooks.collectives import TRACER

MESH = "dp_shard=2,tp=2"
RANKS = 4


def is_a(i: int) -> bool:
    """Whether item ``i`` of an interleaved A/B run is an A: A B B A A B B A ... (neither side always first)."""
    return (i + 1) // 2 % 2 == 0


def worker(pairs: int, warmup: int, profile: bool) -> None:
    args = parse_args(["--mesh", MESH, "--opsd-monitor", "--steps", str(warmup + 2 * pairs)])
    spec, cfg, microbatches = check_layout(args, int(os.environ["WORLD_SIZE"]))
    device = init_distributed()
    meshes = build_mesh(spec, device.type)
    torch.manual_seed(args.seed)
    model = parallelize(lambda: Transformer(cfg), spec, meshes, device, microbatches=microbatches)
    optimizer = torch.optim.AdamW(model.module.parameters(), lr=args.lr, foreach=False)
    data = TokenSource(TokenSourceConfig(cfg.vocab_size, cfg.seq_len, args.batch_size, seed=args.seed))
    monitor = make_monitor(args, cfg, meshes)
    profiler = cProfile.Profile() if profile and dist.get_rank() == 0 else None
    times: dict[bool, list[float]] = {True: [], False: []}
    ratios: list[float] = []  # per adjacent pair (one step on, one off)
    for i in range(warmup + 2 * pairs):
        on = is_a(i)
        if on:
            TRACER.install()
        else:
            TRACER.uninstall()
        inputs, targets = local_batch(model, *data.next_batch(), device)
        dist.barrier()
        if profiler is not None and on:
            profiler.enable()
        start = time.perf_counter()
        if on:
            monitor.begin_step()
        model.forward_backward(inputs, targets)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if on:
            monitor.end_step(model.local_tokens)
        elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
        if profiler is not None:
            profiler.disable()
        TRACER.uninstall()  # the job's own bookkeeping below is not part of either side
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times[on].append(float(elapsed))
            if (i - warmup) % 2 == 1:
                ratios.append(times[True][-1] / times[False][-1])
    monitor.close()
    if dist.get_rank() == 0:
        on_s, off_s = statistics.median(times[True]), statistics.median(times[False])
        print(f"steps per side={pairs} median step on={on_s * 1e3:.3f} ms off={off_s * 1e3:.3f} ms", flush=True)
        print(f"reports sent={monitor.steps} dropped={monitor.dropped_reports}", flush=True)
        if profiler is not None:
            stats = pstats.Stats(profiler)
            stats.sort_stats("tottime").print_stats(r"trainer_hooks", 12)
        print(f"ratio of the medians={on_s / off_s:.4f}", flush=True)
        print(f"hook_overhead_ratio={statistics.median(ratios):.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def drain(sock: socket.socket, received: list[int]) -> None:
    """The agent's side of the socket: read and count the reports until the socket is closed."""
    while True:
        try:
            sock.recv(65536)
        except OSError:
            return
        received[0] += 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.hook_overhead", description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=60, help="steps per side")
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.pairs, args.warmup, args.profile)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "agent.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        received = [0]
        reader = threading.Thread(target=drain, args=(sock, received), daemon=True)
        reader.start()
        env = {**os.environ, "OMP_NUM_THREADS": "1", AGENT_SOCKET_ENV: path}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}"]
        cmd += ["-m", "bench.hook_overhead", "--worker", "--pairs", str(args.pairs), "--warmup", str(args.warmup)]
        cmd += ["--profile"] if args.profile else []
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        sock.close()
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
        return proc.returncode
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    print("\n".join(lines[:-1]))
    print(f"reports received by the socket={received[0]}")
    print(lines[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
