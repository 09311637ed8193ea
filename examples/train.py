"""Reference hybrid-parallel trainer: HSDP/FSDP2, tensor, pipeline, context and expert parallel.

    torchrun --nproc-per-node 4 -m examples.train --mesh dp_shard=2,tp=2 --steps 10

Without torchrun it runs as a single process (world size 1), the reference that every layout is compared with.
CUDA + NCCL are used when a GPU is visible, else CPU + gloo.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore

from examples.config import ModelConfig
from examples.data import TokenSource, TokenSourceConfig
from examples.model import Transformer, model_shape
from examples.parallelize import (
    Meshes,
    ParallelModel,
    batch_shard_index,
    build_mesh,
    lm_loss,
    parallelize,
)
from examples.report import gather_digests, state_digest, state_hashes, write_report
from examples.train_options import DTYPES, model_config, parse_args
from opsd.protocol.ft import EXIT_NO_QUORUM, ReplicaGroupEnv, group_layout
from opsd.protocol.mesh import LayoutLimits, MeshError, MeshSpec, validate_layout
from trainer_hooks.flops import measure_flops_per_token
from trainer_hooks.monitor import Monitor, MonitorConfig
from trainer_hooks.policy_reader import PolicyReader, policy_source
from trainer_hooks.process_exit import run_and_exit

if TYPE_CHECKING:
    from examples.ft import FaultTolerance
    from trainer_hooks.checkpoint import CheckpointConfig, Checkpointer, TrainState
    from trainer_hooks.integrations.torchft import PeerFailures

log = logging.getLogger("examples.train")

#: how often a rank of a fault-tolerant job looks for a replica group opsd names failed: a stat of the policy file,
#: or a request to its agent's /v1/policy (a pod without the host directory)
PEER_FAILURES_EVERY_S = 0.1
PEER_FAILURES_URL_EVERY_S = 0.5


def check_layout(args: argparse.Namespace, world_size: int) -> tuple[MeshSpec, ModelConfig, int]:
    """Validate the command line before any process group exists; raises ValueError with one line."""
    if args.steps < 0:
        raise ValueError("--steps must be >= 0")
    cfg = model_config(args)
    spec = MeshSpec.parse(args.mesh, world_size)
    microbatches = args.microbatches or spec.pp
    if microbatches < 1:
        raise ValueError("--microbatches must be >= 1")
    if args.lr_warmup_steps < 0 or args.ckpt_every < 0:
        raise ValueError("--lr-warmup-steps and --ckpt-every must be >= 0")
    if args.ft_heal_min_mb_per_s <= 0:
        raise ValueError("--ft-heal-min-mb-per-s must be > 0")
    if args.resume and not args.ckpt_dir:
        raise ValueError("--resume needs --ckpt-dir")
    if args.ckpt_dir:
        checkpoint_config(args)  # validates the URL, the endpoint and the retention
    limits = LayoutLimits(
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        n_layers=cfg.n_layers,
        n_experts=cfg.n_experts,
        seq_len=cfg.seq_len,
        batch_size=args.batch_size,
        microbatches=microbatches,
    )
    validate_layout(spec, world_size, limits)
    return spec, cfg, microbatches


#: NCCL records a start event per collective, and accepts the monitor's completion hook, only with this set before
#: the process group is created (it is read once, then): GPU durations of the collectives are the default
NCCL_TIMING_ENV = "TORCH_NCCL_ENABLE_TIMING"


def init_distributed() -> torch.device:
    """Join the job started by torchrun, or form a world of one; CUDA + NCCL when a GPU is visible (with NCCL's
    collective timing on, unless ``TORCH_NCCL_ENABLE_TIMING`` says otherwise)."""
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        os.environ.setdefault(NCCL_TIMING_ENV, "1")
        torch.cuda.set_device(device)
    backend = "nccl" if use_cuda else "gloo"
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, device_id=device if use_cuda else None)
    else:
        dist.init_process_group(backend, store=HashStore(), rank=0, world_size=1)
    return device


def local_batch(
    model: ParallelModel, inputs: torch.Tensor, targets: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows (data-parallel shard) and columns (context-parallel chunk) of the global batch."""
    spec, coords = model.spec, model.coords
    rows = inputs.shape[0] // spec.batch_shards
    first_row = batch_shard_index(spec, coords) * rows
    cols = inputs.shape[1] // spec.cp
    first_col = coords["cp"] * cols
    window = (slice(first_row, first_row + rows), slice(first_col, first_col + cols))
    model.local_tokens = rows * cols
    return inputs[window].to(device), targets[window].to(device)


def global_loss(local: torch.Tensor | None, spec: MeshSpec, device: torch.device) -> float:
    """Mean loss over the global batch: every rank holding the last stage has its shard's mean (all shards are
    the same size); tp peers hold the same value, so the world sum is divided by world / pp."""
    total = torch.zeros((), device=device) if local is None else local.to(device).clone()
    dist.all_reduce(total)
    return float(total) / (spec.world_size // spec.pp)


def measured_flops_per_token(cfg: ModelConfig) -> float:
    """FLOPs per token counted on one forward + backward of a whole, unsharded copy of the model on the CPU, on
    one sequence (the training run's random state is left as it was)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Transformer(cfg)
        tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len + 1))
        return measure_flops_per_token(model, tokens[:, :-1], tokens[:, 1:], lm_loss)


def make_monitor(args: argparse.Namespace, cfg: ModelConfig, meshes: Meshes, first_rank: int = 0) -> Monitor:
    """The opsd monitor of this rank: every mesh dimension labelled, the FSDP groups labelled ``dp_shard``.
    ``first_rank``: the job's rank of this world's rank 0 (a replica group's, with ``--ft``)."""
    with torch.device("meta"):
        full = Transformer(cfg)  # shape only: no memory, no draw from the seeded generator
    shape = model_shape(full)
    measured = measured_flops_per_token(cfg) if args.opsd_flops == "measured" else None
    jsonl = args.opsd_jsonl.replace("{rank}", str(first_rank + dist.get_rank())) if args.opsd_jsonl else None
    config = MonitorConfig(
        peak_flops_per_s=args.peak_flops, jsonl_path=jsonl, collective_timeout_s=args.opsd_collective_timeout_s
    )
    monitor = Monitor.from_mesh(meshes.world, shape, config, flops_per_token=measured)
    for mesh in (meshes.dense, meshes.expert):
        names = mesh.mesh_dim_names or ()
        for name in names:
            monitor.label(mesh.get_group(name), "dp_replicate" if name == "dp_replicate" else "dp_shard")
    return monitor


def checkpoint_config(args: argparse.Namespace) -> CheckpointConfig:
    from opsd.checkpoints.s3 import S3Options
    from trainer_hooks.checkpoint import CheckpointConfig

    return CheckpointConfig(
        args.ckpt_dir,
        every_steps=args.ckpt_every,
        keep_last=args.ckpt_keep_last,
        keep_every_steps=args.ckpt_keep_every,
        async_save=not args.ckpt_sync,
        async_mode=args.ckpt_async,
        when_busy=args.ckpt_when_busy,
        s3=S3Options(endpoint_url=args.ckpt_s3_endpoint),
    )


def _before_commit(args: argparse.Namespace) -> Callable[[int], None] | None:
    """Fault injection before a manifest: rank 0 killed, or held up (a slow store)."""
    if not (args.kill_before_commit_step or args.slow_commit_step):
        return None

    def inject(step: int) -> None:
        if step == args.kill_before_commit_step:
            log.warning("fault injection: killed in the save of step %d, before its manifest", step)
            os.kill(os.getpid(), signal.SIGKILL)
        if step == args.slow_commit_step:
            log.warning("fault injection: the manifest of step %d held up %.1f s", step, args.slow_commit_s)
            time.sleep(args.slow_commit_s)

    return inject


def make_checkpointer(
    args: argparse.Namespace,
    spec: MeshSpec,
    monitor: Monitor | None,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    **extra: Any,
) -> tuple[Checkpointer | None, TrainState | None]:
    """The checkpointer and the state it saves, when ``--ckpt-dir`` is given (torch's DCP is imported only then)."""
    if not args.ckpt_dir:
        return None, None
    from trainer_hooks.checkpoint import Checkpointer, TrainState

    source = policy_source()  # the agent's policy file, or its URL for a pod without the host directory
    policy = PolicyReader(source) if source else None
    on_saved = monitor.record_checkpoint if monitor is not None else None
    on_skipped = monitor.record_checkpoint_skipped if monitor is not None else None
    checkpointer = Checkpointer(
        checkpoint_config(args),
        world_layout=spec.degrees(),
        policy=policy,
        on_saved=on_saved,
        on_skipped=on_skipped,
        on_busy=monitor.activity if monitor is not None else None,
        before_commit=_before_commit(args),
    )
    return checkpointer, TrainState(model, optimizer, **extra)


def peer_failures(args: argparse.Namespace, replica: ReplicaGroupEnv) -> PeerFailures | None:
    """The replica groups opsd names failed, read from the policy (``--ft``; none with ``--ft-ignore-opsd`` or
    without a policy to read)."""
    source = policy_source()
    if args.ft_ignore_opsd or not source:
        return None
    from trainer_hooks.integrations.torchft import PeerFailures

    every_s = PEER_FAILURES_URL_EVERY_S if "://" in source else PEER_FAILURES_EVERY_S
    return PeerFailures(PolicyReader(source, check_every_s=every_s), replica.group)


def _watch_logits_dtype(model: ParallelModel) -> list[str]:
    """The dtype the output layer computes in, seen on its first forward (on the last pipeline stage; for the
    report: bf16 logits without autocast means FSDP2's mixed precision cast the weights)."""
    seen: list[str] = []
    output = model.module.output
    if output is not None:

        def hook(module: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
            if not seen:
                seen.append(str(out.dtype).removeprefix("torch."))

        output.register_forward_hook(hook)
    return seen


def train(
    args: argparse.Namespace,
    spec: MeshSpec,
    cfg: ModelConfig,
    microbatches: int,
    replica: ReplicaGroupEnv | None = None,
) -> list[float]:
    """Train; with ``replica`` (``--ft``) this process is a rank of one replica group of ``spec``."""
    device = init_distributed()
    ft: FaultTolerance | None = None
    try:
        group = spec if replica is None else group_layout(spec, replica)
        meshes = build_mesh(group, device.type)
        torch.manual_seed(args.seed)
        model = parallelize(
            lambda: Transformer(cfg),
            group,
            meshes,
            device,
            microbatches=microbatches,
            schedule=args.pp_schedule,
            dtype=DTYPES[args.dtype],
            shard_always=replica is not None,
        )
        optimizer = torch.optim.AdamW(
            model.module.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0, foreach=False
        )
        data = TokenSource(
            TokenSourceConfig(
                vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, batch_size=args.batch_size, seed=args.seed
            )
        )
        warmup = args.lr_warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda i: min(1.0, (i + 1) / warmup) if warmup else 1.0
        )
        first_rank = replica.group * dist.get_world_size() if replica is not None else 0
        monitor = make_monitor(args, cfg, meshes, first_rank) if args.opsd_monitor else None
        if monitor is not None and spec.pp > 1:  # the schedule its bubble is compared to
            monitor.watch_pipeline(args.pp_schedule, stages=spec.pp, microbatches=microbatches)
        ckpt, state = make_checkpointer(args, group, monitor, model.module, optimizer, data=data, scheduler=scheduler)
        # a replica group relaunched while its peers train heals from them: no checkpoint read (examples/ft.py)
        from_peer = replica is not None and replica.heal_from_peer
        resumed = ckpt.load(state) if ckpt is not None and state is not None and args.resume and not from_peer else None
        if replica is not None:  # last before the first step: from here on the Lighthouse counts the group alive
            from examples.ft import FaultTolerance, in_job

            model = in_job(model, spec, replica.group)
            ft = FaultTolerance(
                replica,
                model,
                optimizer,
                scheduler,
                data,
                monitor=monitor,
                peer_failures=peer_failures(args, replica),
                kill_while_healing=args.ft_kill_while_healing,
                heal_read_bytes_per_s=args.ft_heal_read_bytes_per_s,
                heal_min_bytes_per_s=args.ft_heal_min_mb_per_s * 1e6,
                wedge_at=(args.ft_wedge_at_step, args.ft_wedge_group),
                wedge_file=args.ft_wedge_file,
            )
        rank0 = dist.get_rank() == 0
        if rank0:
            print(f"layout {spec} on {spec.world_size} rank(s), {device.type}/{dist.get_backend()}", flush=True)
            if resumed is not None:
                print(f"resumed from the checkpoint of step {resumed}", flush=True)
            elif from_peer:
                print("relaunched while the other groups train: healing from one, no checkpoint read", flush=True)
        first_step = data.position
        if monitor is not None:
            monitor.resume_at(first_step)  # reports number steps as training does
        logits_dtype = _watch_logits_dtype(model)
        losses: list[float] = []
        digests: dict[int, bytes] = {}
        ft_loss: float | None = None
        while data.position < last_step(args):
            if ft is not None:
                ft.start_step()  # the quorum is asked for; the data position is the job's step
            inputs, targets = local_batch(model, *data.next_batch(), device)
            with monitor.step(tokens=model.local_tokens * spec.cp) if monitor else contextlib.nullcontext():
                local = model.forward_backward(inputs, targets)
                if monitor is not None and local is not None:
                    monitor.record_loss(local)  # this rank's shard of the batch: no collective in the step
                with monitor.phase("optimizer") if monitor else contextlib.nullcontext():
                    if ft is None:
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                        scheduler.step()
                    else:
                        ft_loss = ft.finish_step(local, spec.pp)  # None: discarded, the same batch comes again
            loss = global_loss(local, spec, device) if ft is None else ft_loss
            if loss is None:
                continue
            losses.append(loss)
            step = data.position - 1  # the step just done (a group that healed has its peers' step)
            if args.state_digests:
                digests[step + 1] = state_digest(model.module, optimizer)
            if rank0:
                print(f"step {step + 1}/{args.steps} loss {losses[-1]:.6f}", flush=True)
            # the cadence's steps, and the last one: a completed run's final state is always checkpointed
            saves = ft is None or ft.saves_checkpoints()  # with --ft, one replica group writes the checkpoints
            last = step + 1 == last_step(args)
            if ckpt is not None and state is not None and saves and (ckpt.due(step + 1) or last):
                # a save due while the previous one writes is skipped, but the last one and one asked for
                ckpt.save(step + 1, state, wait=last or ckpt.required(step + 1))
            if args.kill_at_step == step + 1 and dist.get_rank() == args.kill_rank:
                if ckpt is not None:
                    ckpt.wait()  # the checkpoints before the failure are committed
                os.kill(os.getpid(), signal.SIGKILL)
        if ckpt is not None:
            ckpt.close()
        if monitor is not None:
            monitor.close()
        if args.losses_out is not None:
            autocast = str(model.autocast_dtype).removeprefix("torch.") if model.autocast_dtype else None
            extra: dict[str, Any] = {"first_step": first_step, "autocast": autocast, "logits_dtype": logits_dtype}
            if ckpt is not None and state is not None:
                extra.update(
                    resumed_from_step=resumed, resume_problems=ckpt.resume_problems, state_hashes=state_hashes(state)
                )
            if args.state_digests:  # every rank did the same steps: one gather each
                extra["step_digests"] = {str(s): gather_digests(d) for s, d in sorted(digests.items())}
            if ft is not None:
                hashes = gather_digests(state_digest(model.module, optimizer))
                extra.update(
                    replica_group=ft.replica.group,
                    heals=ft.heals,
                    state_hashes=hashes,
                    discarded_steps=ft.discarded,
                    healing_s=ft.healing_total_s,
                    commit_times_unix_s=ft.commit_times_unix_s,
                    checkpoint_read=resumed is not None,
                )
            path = Path(str(args.losses_out).replace("{replica_group}", str(replica.group if replica else 0)))
            write_report(path, model, cfg, losses, tokens_per_step=args.batch_size * cfg.seq_len, **extra)
        dist.barrier()
        return losses
    finally:
        if ft is not None:
            ft.close()
        # No barrier here: after an error on this rank its peers may never reach one, and waiting for them
        # would hide the error behind a hang. torchrun sees the exit code and stops the other ranks.
        if dist.is_initialized():
            dist.destroy_process_group()


def last_step(args: argparse.Namespace) -> int:
    """``--steps``, or the step written in ``--steps-file`` once it is there (a test ends a run when it chooses)."""
    if args.steps_file is not None:
        with contextlib.suppress(OSError, ValueError):
            return int(args.steps_file.read_text())
    return int(args.steps)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        replica = ReplicaGroupEnv.from_env(os.environ) if args.ft else None
        spec, cfg, microbatches = check_layout(args, world_size * (replica.groups if replica else 1))
        if replica is not None:
            group_layout(spec, replica)
    except (MeshError, ValueError) as exc:
        print(f"examples.train: error: {exc}", file=sys.stderr)
        return 2
    if replica is None:
        train(args, spec, cfg, microbatches)
        return 0
    from examples.ft import HealTooSlowError, NoQuorumError

    try:
        train(args, spec, cfg, microbatches, replica)
    except NoQuorumError as exc:
        print(f"examples.train: replica group {replica.group}: {exc}", file=sys.stderr)
        return EXIT_NO_QUORUM
    except HealTooSlowError as exc:
        print(f"examples.train: replica group {replica.group} gives up healing: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    run_and_exit(main)  # the exit code main means, whatever gloo's threads are doing (docs/crash.md)
