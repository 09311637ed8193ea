"""Every figure of opsd's GPU paths, in one command: ``python -m bench.gpu_check`` (``make gpu-check``).

Made for one GPU (it runs on several, and on the CPU with ``--tiny``, which is how it is tested) with no network,
in well under 5 minutes. Each part runs in a process of its own and prints ``name=value`` lines; the command prints
the device and the versions first, then every part's figures (docs/gpu.md says what each one means):

- ``collectives``: a world of one on NCCL (gloo on CPU) with the monitor: all-gathers of 1 GiB (1 MiB tiny; out of
  place, so that even a world of one copies the data on the device) timed by the process group's completion hook,
  against CUDA events around them (the host on CPU), after one that is not timed (NCCL creates its communicator at
  the first collective); the timing source and its fallbacks; then a Flight Recorder dump: its entries per backend,
  and the collectives the analysis reads;
- ``overhead``: ``bench.hook_overhead`` (per-step pairs, blocks of steps, the host cost of a traced collective);
- ``mfu``: the reference model in bf16 on the device: FLOPs per token by the formula and by ``FlopCounterMode``,
  the step time and MFU with each;
- ``checkpoint``: ``bench.checkpoint_stall`` (blocking seconds of each kind of save, training time lost while
  each async writer writes, opsd's sync save against plain DCP);
- ``nvml``: the agent's NVML source: GPUs, fields read, fields not supported, failed reads.

A part that fails prints ``<part>_failed=1`` and the command goes on to the next; it exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

PARTS = ("collectives", "overhead", "mfu", "checkpoint", "nvml")
#: the figures each part prints (the test checks that each one is there)
FIGURES: dict[str, tuple[str, ...]] = {
    "collectives": (
        "collective_all_gather_s",
        "collective_reported_over_measured_ratio",
        "collective_timing_source",
        "collective_timing_fallbacks",
        "flight_recorder_entries_gloo",
        "flight_recorder_entries_nccl",
        "flight_recorder_collectives_read",
    ),
    "overhead": ("hook_cost_per_collective_us", "hook_overhead_block_ratio", "hook_overhead_ratio"),
    "mfu": (
        "flops_per_token_formula",
        "flops_per_token_measured",
        "step_s_bf16",
        "mfu_bf16_formula",
        "mfu_bf16_measured",
    ),
    "checkpoint": (
        "checkpoint_blocking_s_dcp",
        "checkpoint_blocking_s_sync",
        "checkpoint_blocking_s_thread",
        "checkpoint_blocking_s_process",
        "checkpoint_lost_training_s_thread",
        "checkpoint_lost_training_s_process",
        "checkpoint_sync_vs_dcp_ratio",
        "checkpoint_blocking_vs_dcp_ratio",
    ),
    "nvml": ("nvml_gpus", "nvml_fields_read", "nvml_fields_unsupported", "nvml_field_errors"),
}
# the model of the overhead and MFU parts: (dim, layers, heads, kv heads, ffn hidden, seq len, batch, vocab)
GPU_MODEL = (2048, 8, 16, 8, 5504, 2048, 4, 32000)
TINY_MODEL = (64, 2, 4, 2, 128, 32, 4, 128)


def model_args(tiny: bool) -> list[str]:
    dim, layers, heads, kv, ffn, seq, batch, vocab = TINY_MODEL if tiny else GPU_MODEL
    return [
        *("--dim", str(dim), "--layers", str(layers), "--heads", str(heads), "--kv-heads", str(kv)),
        *("--ffn-hidden", str(ffn), "--seq-len", str(seq), "--batch-size", str(batch), "--vocab-size", str(vocab)),
    ]


def say(name: str, value: object) -> None:
    print(f"{name}={value}", flush=True)


def part_collectives(tiny: bool) -> None:
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import HashStore  # type: ignore[attr-defined]
    from torch.distributed.device_mesh import init_device_mesh

    from bench.devices import synchronize
    from opsd.analysis.flight_recorder import read_dump
    from opsd.protocol.flight_dump import as_dump
    from trainer_hooks.collectives import TRACER
    from trainer_hooks.monitor import Monitor, MonitorConfig

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")  # before the process group: GPU durations
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", store=HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp_shard",))
    group = mesh.get_group("dp_shard")
    with tempfile.TemporaryDirectory() as tmp:
        config = MonitorConfig(run_id="gpu-check", jsonl_path=f"{tmp}/steps.jsonl", flight_dir=f"{tmp}/flight")
        monitor = Monitor.from_mesh(mesh, None, config)
        x = torch.ones((1 << 18) if tiny else (1 << 28), device=device)  # 1 MiB / 1 GiB of float32
        out = torch.empty_like(x)
        dist.all_gather_into_tensor(out, x, group=group)  # not timed: NCCL sets its communicator up in the first one
        synchronize(device)
        calls = 4
        measured = 0.0
        for _ in range(6):
            with monitor.step(tokens=1):
                start_event = torch.cuda.Event(enable_timing=True) if cuda else None
                end_event = torch.cuda.Event(enable_timing=True) if cuda else None
                synchronize(device)
                started = time.perf_counter()
                if start_event is not None:
                    start_event.record()
                for _ in range(calls):
                    dist.all_gather_into_tensor(out, x, group=group)
                if end_event is not None:
                    end_event.record()
                synchronize(device)
                ended = time.perf_counter()
            if start_event is not None and end_event is not None:
                measured += start_event.elapsed_time(end_event) / 1000.0
            else:
                measured += ended - started
        monitor.close()
        reports = [json.loads(line) for line in Path(f"{tmp}/steps.jsonl").read_text().splitlines()]
        reported = sum(entry[4] for r in reports for entry in r["comms"] if entry[1] == "all_gather")
        say("collective_all_gather_s", f"{reported / (6 * calls):.6g}")
        say("collective_reported_over_measured_ratio", f"{reported / measured:.4f}" if measured > 0 else "nan")
        say("collective_timing_source", "host" if TRACER.host_timed(group) else "gpu")
        say("collective_timing_fallbacks", TRACER.timing_fallbacks)
        path = monitor.flight.dump("gpu-check")
        body = json.loads(path.read_text()) if isinstance(path, Path) else {}
        say("flight_recorder_entries_gloo", len(body.get("trace", {}).get("entries", [])))
        say("flight_recorder_entries_nccl", len(body.get("nccl_trace", {}).get("entries", [])))
        seen = read_dump(0, as_dump(body), (0,)) if body else None  # no dump written: nothing read
        say("flight_recorder_collectives_read", sum(g.enqueued or 0 for g in seen.groups.values()) if seen else 0)
    dist.destroy_process_group()


def part_mfu(tiny: bool) -> None:
    import torch
    import torch.distributed as dist

    from bench.devices import synchronize
    from examples.model import Transformer, model_shape
    from examples.parallelize import build_mesh, lm_loss, parallelize
    from examples.train import check_layout, init_distributed
    from examples.train_options import model_config, parse_args
    from trainer_hooks.flops import measure_flops_per_token
    from trainer_hooks.monitor import Monitor, MonitorConfig

    args = parse_args([*model_args(tiny), "--dtype", "bf16"])
    spec, cfg, _ = check_layout(args, 1)
    device = init_distributed()
    meshes = build_mesh(spec, device.type)
    torch.manual_seed(0)
    model = parallelize(lambda: Transformer(cfg), spec, meshes, device, microbatches=1, dtype=torch.bfloat16)
    with torch.device("meta"):
        shape = model_shape(Transformer(model_config(args)))
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len + 1), device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        measured = measure_flops_per_token(model.module, tokens[:, :-1], tokens[:, 1:], lm_loss)
    monitor = Monitor.from_mesh(meshes.world, shape, MonitorConfig(run_id="gpu-check"))
    optimizer = torch.optim.AdamW(model.module.parameters(), lr=1e-4, foreach=device.type == "cuda")
    batch = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.seq_len + 1), device=device)
    model.local_tokens = args.batch_size * cfg.seq_len
    step_s, mfu = [], []
    for _ in range(8):
        with monitor.step(tokens=model.local_tokens):
            model.forward_backward(batch[:, :-1], batch[:, 1:])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        report = monitor.last_report
        if report is not None:
            step_s.append(report.step_s)
            mfu.append(report.mfu_ratio)
    synchronize(device)
    monitor.close()
    if monitor.last_report is not None:
        step_s.append(monitor.last_report.step_s)
        mfu.append(monitor.last_report.mfu_ratio)
    say("flops_per_token_formula", f"{monitor.flops_per_token:.6e}")
    say("flops_per_token_measured", f"{measured:.6e}")
    say("step_s_bf16", f"{statistics.median(step_s[2:]):.6g}")
    formula_mfu = statistics.median(mfu[2:])
    say("mfu_bf16_formula", f"{formula_mfu:.4f}")
    say("mfu_bf16_measured", f"{formula_mfu * measured / monitor.flops_per_token:.4f}")
    dist.destroy_process_group()


def part_nvml(tiny: bool) -> None:
    from opsd.errors import OpsError
    from opsd_agent.gpu import NvmlSource

    # the source's warnings (a call NVML fails, and why) on stdout as notes, printed with the figures
    logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="# %(message)s")

    try:
        source = NvmlSource()
    except (OpsError, ImportError) as exc:
        print(f"no NVML here: {exc}", flush=True)
        for name in FIGURES["nvml"]:
            say(name, 0)
        return
    samples = source.sample()
    names = [f.name for f in fields(samples[0])] if samples else []
    values = [getattr(s, n) for s in samples for n in names if n not in ("index", "uuid")]
    say("nvml_gpus", len(samples))
    say("nvml_fields_read", sum(1 for v in values if v is not None))
    say("nvml_fields_unsupported", sum(1 for v in values if v is None))
    say("nvml_field_errors", sum(source.field_errors.values()))
    for (gpu, field), n in sorted(source.field_errors.items()):
        print(f"# gpu {gpu}: {field} not read ({n} failed reads)", flush=True)
    source.close()


def bench_command(part: str, tiny: bool) -> list[str]:
    """The benchmark a part runs, with the sizes of the check (tiny: one CPU rank, a tiny model)."""
    ranks = ["--ranks", "1"] if tiny else []
    if part == "overhead":
        counts = ["--pairs", "4", "--warmup", "2", "--blocks", "2", "--block-steps", "2", "--calls", "20"]
        if not tiny:
            counts = ["--pairs", "30", "--warmup", "4", "--blocks", "6", "--block-steps", "8", "--calls", "200"]
        return [sys.executable, "-m", "bench.hook_overhead", *ranks, *counts, *model_args(tiny), "--dtype", "bf16"]
    size = ["--dim", "64", "--layers", "1"] if tiny else ["--dim", "2048", "--layers", "4"]
    return [sys.executable, "-m", "bench.checkpoint_stall", *ranks, *size, "--rounds", "1", "--max-steps", "50"]


def run_part(part: str, tiny: bool, timeout_s: float) -> list[str]:
    """Run one part in a process of its own; the ``name=value`` lines it printed (``<part>_failed=1`` if none)."""
    if part in ("overhead", "checkpoint"):
        cmd = bench_command(part, tiny)
    else:
        cmd = [sys.executable, "-m", "bench.gpu_check", "--part", part, *(["--tiny"] if tiny else [])]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        output, failed = proc.stdout, proc.returncode != 0
    except subprocess.TimeoutExpired as exc:
        output, failed = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or ""), True
        proc = None
    wanted = FIGURES[part]
    lines = [line for line in output.splitlines() if "=" in line and line.split("=", 1)[0] in wanted]
    print(f"# {part}: {time.perf_counter() - started:.1f} s", flush=True)
    for note in (line for line in output.splitlines() if line.startswith("# ")):  # what a part says of its figures
        print(note, flush=True)
    if failed or len(lines) < len(wanted):
        tail = proc.stderr[-2000:] if proc is not None else "timed out"
        print(f"# {part} failed:\n{tail}", file=sys.stderr, flush=True)
        lines.append(f"{part}_failed=1")
    return lines


def versions() -> list[str]:
    import torch

    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else f"cpu ({platform.processor() or platform.machine()})"
    nccl = ".".join(str(v) for v in torch.cuda.nccl.version()) if cuda else "none"
    return [
        f"device={device}",
        f"devices={torch.cuda.device_count() if cuda else 0}",
        f"python={platform.python_version()}",
        f"torch={torch.__version__}",
        f"cuda={torch.version.cuda or 'none'}",
        f"nccl={nccl}",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny sizes, one rank (the CPU check of the command itself)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"which parts, of {','.join(PARTS)}")
    p.add_argument("--part-timeout-s", type=float, default=240.0)
    p.add_argument("--part", choices=("collectives", "mfu", "nvml"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.part is not None:
        {"collectives": part_collectives, "mfu": part_mfu, "nvml": part_nvml}[args.part](args.tiny)
        return 0
    parts = [part for part in args.parts.split(",") if part]
    if unknown := [part for part in parts if part not in PARTS]:
        p.error(f"unknown part(s) {', '.join(unknown)}; known: {', '.join(PARTS)}")
    for line in versions():
        print(line, flush=True)
    failed = False
    for part in parts:
        for line in run_part(part, args.tiny, args.part_timeout_s):
            print(line, flush=True)
            failed |= line.endswith("_failed=1")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
