"""The reference trainer's command line (``examples.train``): its options and the model they describe."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch

from examples.config import ModelConfig
from examples.parallelize import SCHEDULES
from opsd.protocol.ft import HEAL_MIN_BYTES_PER_S

#: --dtype: the compute dtype (weights, gradient reduction and optimizer stay float32)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="examples.train", description=__doc__.splitlines()[0])
    p.add_argument(
        "--mesh",
        default="",
        help="e.g. dp_replicate=2,dp_shard=2,tp=1,pp=1,cp=1,ep=1 (unnamed = 1; dp_shard=-1: the rest of the world)",
    )
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8, help="global batch, in sequences")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=128)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn-hidden", type=int, default=128)
    p.add_argument("--experts", type=int, default=0, help="experts per MoE layer (0: dense MLP)")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--shared-experts", type=int, default=0)
    p.add_argument("--capacity-factor", type=float, default=0.0, help="0: no token dropping")
    p.add_argument("--aux-loss-coef", type=float, default=0.01)
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="fp32",
        help="compute dtype: bf16 (FSDP2's mixed precision where sharded, autocast elsewhere) or fp32 (the reference)",
    )
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--microbatches", type=int, default=0, help="pipeline micro-batches (default: pp)")
    p.add_argument("--pp-schedule", choices=sorted(SCHEDULES), default="1f1b")
    p.add_argument("--opsd-monitor", action="store_true", help="report every step with trainer_hooks")
    p.add_argument("--opsd-jsonl", help="also write the reports to this file; {rank} is replaced by the rank")
    p.add_argument(
        "--opsd-collective-timeout-s",
        type=float,
        default=300.0,
        help="report a wait on one collective longer than this to the agent (0: never)",
    )
    p.add_argument(
        "--opsd-flops",
        choices=("formula", "measured"),
        default="formula",
        help="MFU's FLOPs per token: from the model shape, or counted once at start-up (FlopCounterMode)",
    )
    p.add_argument("--peak-flops", type=float, help="peak FLOP/s of one device for MFU (default: device table)")
    p.add_argument("--lr-warmup-steps", type=int, default=0, help="linear LR warm-up (part of the checkpoint)")
    p.add_argument("--ckpt-dir", help="checkpoint location: file:///path, a path or s3://bucket/prefix (none: none)")
    p.add_argument(
        "--ckpt-every",
        type=int,
        default=0,
        help="save every K steps (the controller's policy wins) and after the last step",
    )
    p.add_argument("--ckpt-sync", action="store_true", help="synchronous saves (default: asynchronous)")
    p.add_argument(
        "--ckpt-async",
        choices=["thread", "process"],
        default="thread",
        help="where asynchronous saves write: a thread of the rank, or a helper process per rank",
    )
    p.add_argument(
        "--ckpt-when-busy",
        choices=["skip", "wait"],
        default="skip",
        help="a save due while the previous one is still writing: skip it (training never waits) or wait for it",
    )
    p.add_argument("--ckpt-s3-endpoint", help="S3-compatible endpoint URL for s3:// (default: AWS_ENDPOINT_URL*)")
    p.add_argument("--ckpt-keep-last", type=int, default=3, help="committed checkpoints kept (newest first)")
    p.add_argument("--ckpt-keep-every", type=int, default=0, help="also keep steps that are multiples of this")
    p.add_argument("--resume", action="store_true", help="start from the newest valid checkpoint in --ckpt-dir")
    p.add_argument("--kill-at-step", type=int, default=0, help=argparse.SUPPRESS)  # fault injection (tests)
    p.add_argument("--kill-rank", type=int, default=0, help=argparse.SUPPRESS)
    # fault injection (tests): rank 0 is SIGKILLed in the save of this step, after the shards, before the manifest
    p.add_argument("--kill-before-commit-step", type=int, default=0, help=argparse.SUPPRESS)
    # fault injection (tests): rank 0 waits this long before the manifest of that step (a slow store)
    p.add_argument("--slow-commit-step", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--slow-commit-s", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument(
        "--ft",
        action="store_true",
        help="this job is one dp_replicate replica group of a fault-tolerant job (torchft; REPLICA_GROUP_ID, "
        "NUM_REPLICA_GROUPS and TORCHFT_LIGHTHOUSE set; docs/ft.md)",
    )
    p.add_argument("--ft-kill-while-healing", action="store_true", help=argparse.SUPPRESS)  # fault injection (tests)
    # fault injection (tests): a healing group reads its peer's state at most this fast
    p.add_argument("--ft-heal-read-bytes-per-s", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--ft-heal-min-mb-per-s",
        type=float,
        default=HEAL_MIN_BYTES_PER_S / 1e6,
        help="a healing group gives up reading a peer's state slower than this (its size at this rate, or torchft's "
        "timeout if longer): its peers are held no longer (docs/ft.md)",
    )
    p.add_argument(
        "--ft-ignore-opsd",
        action="store_true",
        help="wait out a collective with a replica group opsd names failed (its timeout), rather than abandon it",
    )
    # fault injection: replica group G's ranks wedge in step N, their connections held open (examples.ft.wedge);
    # the file is touched then
    p.add_argument("--ft-wedge-at-step", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--ft-wedge-group", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--ft-wedge-file", default=None, help=argparse.SUPPRESS)
    # tests: the hashes of each rank's state after each step, in --losses-out
    p.add_argument("--state-digests", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--steps-file",
        type=Path,
        help="the last step, read from this file once it is there (a supervisor ends the run when it chooses)",
    )
    p.add_argument(
        "--losses-out",
        type=Path,
        help="write the per-step global losses as JSON (rank 0; {replica_group} is replaced by the group with --ft)",
    )
    p.add_argument("--log-level", default="WARNING")
    return p.parse_args(argv)


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        vocab_size=args.vocab_size,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        ffn_hidden=args.ffn_hidden,
        seq_len=args.seq_len,
        n_experts=args.experts,
        top_k=args.top_k,
        n_shared_experts=args.shared_experts,
        capacity_factor=args.capacity_factor,
        aux_loss_coef=args.aux_loss_coef,
    )
