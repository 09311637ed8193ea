"""What the opsd monitor costs a training step: ``python -m bench.hook_overhead``.

Runs the reference trainer in one job, one rank per GPU on CUDA (NCCL), else 4 CPU ranks (gloo), with a layout that
fits (``dp_shard=2,tp=2`` on 4 ranks; ``bench.devices``), and alternates steps with the monitor (collective tracer
installed, one report per step sent to a live Unix datagram socket) and steps without it, in the order A B B A A B
B A ... so that neither side always runs first. Every step starts at a barrier and ends with the device's queue
drained (both sides alike); a step's time is the slowest rank's. The figure is the median, over adjacent pairs of
steps (one with the monitor, one without), of their ratio: pairing cancels the slow drifts of a shared machine. The
ratio of the median step times is printed too.

``--blocks N`` also alternates blocks of ``--block-steps`` steps, the device drained only at the edges of a block:
there the monitor's cost includes any wait for the device it would cause (a synchronisation per step removes the
overlap of one step's GPU work with the next step's launches): ``hook_overhead_block_ratio``. And the host cost of
one traced collective (a small all-reduce, traced and not, in turns): ``hook_cost_per_collective_us``.

``--framework hf|lightning|fabric`` measures opsd inside a framework's example instead, whole runs with and without
it in turns (``bench.framework_overhead``): ``hook_overhead_<framework>_ratio``.

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

from bench import framework_overhead
from bench.devices import bench_mesh, bench_ranks, synchronize
from examples.data import TokenSource, TokenSourceConfig
from examples.model import Transformer
from examples.parallelize import build_mesh, parallelize
from examples.train import check_layout, init_distributed, local_batch, make_monitor
from examples.train_options import DTYPES, parse_args
from opsd.protocol.env import AGENT_SOCKET_ENV
from trainer_hooks.collectives import TRACER


def is_a(i: int) -> bool:
    """Whether item ``i`` of an interleaved A/B run is an A: A B B A A B B A ... (neither side always first)."""
    return (i + 1) // 2 % 2 == 0


def per_collective_us(device: torch.device, calls: int, rounds: int = 10) -> float:
    """The host cost of one traced collective: a small all-reduce on the world group, ``calls`` times traced and
    as many untraced, in turns; the difference of the medians per call, in microseconds (every rank runs it)."""
    value = torch.ones(1, device=device)
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(2 * rounds):
        on = is_a(r)
        if on:
            TRACER.install()
        synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(value)
        synchronize(device)
        times[on].append((time.perf_counter() - start) / calls)
        TRACER.uninstall()
    TRACER.take_step()
    return (statistics.median(times[True]) - statistics.median(times[False])) * 1e6


def worker(argv: list[str], pairs: int, warmup: int, blocks: int, block_steps: int, calls: int, profile: bool) -> None:
    args = parse_args([*argv, "--opsd-monitor", "--steps", str(warmup + 2 * pairs)])
    spec, cfg, microbatches = check_layout(args, int(os.environ["WORLD_SIZE"]))
    device = init_distributed()
    meshes = build_mesh(spec, device.type)
    torch.manual_seed(args.seed)
    model = parallelize(
        lambda: Transformer(cfg), spec, meshes, device, microbatches=microbatches, dtype=DTYPES[args.dtype]
    )
    optimizer = torch.optim.AdamW(model.module.parameters(), lr=args.lr, foreach=device.type == "cuda")
    data = TokenSource(TokenSourceConfig(cfg.vocab_size, cfg.seq_len, args.batch_size, seed=args.seed))
    monitor = make_monitor(args, cfg, meshes)
    profiler = cProfile.Profile() if profile and dist.get_rank() == 0 else None

    def one_step(on: bool, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        if on:
            monitor.begin_step()
        local = model.forward_backward(inputs, targets)
        if on and local is not None:
            monitor.record_loss(local)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if on:
            monitor.end_step(model.local_tokens)

    times: dict[bool, list[float]] = {True: [], False: []}
    ratios: list[float] = []  # per adjacent pair (one step on, one off)
    for i in range(warmup + 2 * pairs):
        on = is_a(i)
        if on:
            TRACER.install()
        else:
            TRACER.uninstall()
        inputs, targets = local_batch(model, *data.next_batch(), device)
        synchronize(device)
        dist.barrier()
        if profiler is not None and on:
            profiler.enable()
        start = time.perf_counter()
        one_step(on, inputs, targets)
        synchronize(device)
        elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64, device=device)
        if profiler is not None:
            profiler.disable()
        TRACER.uninstall()  # the job's own bookkeeping below is not part of either side
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times[on].append(float(elapsed))
            if (i - warmup) % 2 == 1:
                ratios.append(times[True][-1] / times[False][-1])
    block_ratios: list[float] = []
    block_times: dict[bool, list[float]] = {True: [], False: []}
    for b in range(2 * blocks):
        on = is_a(b)
        batches = [local_batch(model, *data.next_batch(), device) for _ in range(block_steps)]
        if on:
            TRACER.install()
        synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        for inputs, targets in batches:
            one_step(on, inputs, targets)
        synchronize(device)
        elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64, device=device)
        TRACER.uninstall()
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        block_times[on].append(float(elapsed) / block_steps)
        if b % 2 == 1:
            block_ratios.append(block_times[True][-1] / block_times[False][-1])
    monitor.close()
    cost_us = per_collective_us(device, calls) if calls else None
    if dist.get_rank() == 0:
        on_s, off_s = statistics.median(times[True]), statistics.median(times[False])
        print(
            f"device {device.type} x {dist.get_world_size()} ranks ({dist.get_backend()}), layout {spec}, {args.dtype}"
        )
        print(f"steps per side={pairs} median step on={on_s * 1e3:.3f} ms off={off_s * 1e3:.3f} ms", flush=True)
        print(f"reports sent={monitor.steps} dropped={monitor.dropped_reports}", flush=True)
        if profiler is not None:
            stats = pstats.Stats(profiler)
            stats.sort_stats("tottime").print_stats(r"trainer_hooks", 12)
        if cost_us is not None:
            print(f"hook_cost_per_collective_us={cost_us:.2f}", flush=True)
        if block_ratios:
            on_b, off_b = statistics.median(block_times[True]), statistics.median(block_times[False])
            print(
                f"blocks per side={blocks} of {block_steps} steps: step on={on_b * 1e3:.3f} ms off={off_b * 1e3:.3f} ms"
            )
            print(f"hook_overhead_block_ratio={statistics.median(block_ratios):.4f}", flush=True)
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
    p.add_argument("--blocks", type=int, default=0, help="blocks per side (0: none)")
    p.add_argument("--block-steps", type=int, default=8)
    p.add_argument("--calls", type=int, default=200, help="all-reduces per turn for the cost of a call (0: none)")
    p.add_argument("--ranks", type=int, help="ranks to start (default: one per GPU, else 4 on the CPU)")
    p.add_argument("--mesh", help="the layout (default: one that fits the ranks, bench.devices)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--framework",
        choices=("reference", "hf", "lightning", "fabric"),
        default="reference",
        help="the reference trainer (steps in turns), or a framework's example (runs in turns)",
    )
    p.add_argument("--runs", type=int, default=6, help="--framework: runs in all, half with opsd (even)")
    p.add_argument("--steps", type=int, default=60, help="--framework: steps per run")
    args, model = p.parse_known_args(argv)  # the rest goes to the trainer: --dim, --layers, --dtype, ...
    if args.framework != "reference":
        return framework_overhead.measure(args.framework, args.runs, args.steps, args.warmup)
    if args.warmup % 2 or args.pairs < 1:
        p.error("--warmup must be even and --pairs >= 1 (steps go in pairs)")
    ranks = args.ranks or bench_ranks()
    mesh = bench_mesh(ranks) if args.mesh is None else args.mesh
    counts = (args.pairs, args.warmup, args.blocks, args.block_steps, args.calls)
    if args.worker:
        worker(["--mesh", mesh, *model], *counts, args.profile)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "agent.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        received = [0]
        reader = threading.Thread(target=drain, args=(sock, received), daemon=True)
        reader.start()
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), AGENT_SOCKET_ENV: path}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        cmd += ["-m", "bench.hook_overhead", "--worker", "--mesh", mesh, "--ranks", str(ranks)]
        cmd += ["--pairs", str(args.pairs), "--warmup", str(args.warmup), "--blocks", str(args.blocks)]
        cmd += ["--block-steps", str(args.block_steps), "--calls", str(args.calls), *model]
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
