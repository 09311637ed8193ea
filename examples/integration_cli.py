"""What the framework examples (``examples.hf_trainer``, ``examples.lightning_trainer``) take alike on their command
line: the run's length and shape, the resume, the fault injection and where the losses and the reports go."""

from __future__ import annotations

import argparse
import os


def common_options(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--steps", type=int, default=12)
    p.add_argument(
        "--save-every",
        type=int,
        default=4,
        help="the job's own checkpoint cadence (the Trainer's: besides the controller's; Lightning: until its)",
    )
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--resume", action="store_true", help="from the newest checkpoint of the run's directory")
    p.add_argument(
        "--kill-at-step",
        type=int,
        default=0,
        help="SIGKILL rank 0 after this step (fault injection), in a run started afresh: not once it resumed",
    )
    p.add_argument("--losses-out", help="each optimizer step's loss, as JSON (rank 0)")
    p.add_argument("--opsd-jsonl", help="the step reports also to this file ({rank}: the rank)")
    return p


def launch_layout() -> tuple[int, int]:
    """(ranks per node, nodes) of the launch, from torchrun's environment (``LOCAL_WORLD_SIZE``, ``WORLD_SIZE``), as
    Lightning's ``devices`` and ``num_nodes``: ``torchrun --nproc-per-node 2`` is one node of 2, ``opsd run --nodes 2
    --gpus-per-node 1`` two nodes of one (Lightning places a rank at ``GROUP_RANK x devices + LOCAL_RANK``)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return per_node, max(1, world // per_node)
