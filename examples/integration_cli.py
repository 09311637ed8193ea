"""What the framework examples (``examples.hf_trainer``, ``examples.lightning_trainer``, ``examples.fabric_loop``)
take alike on their command line: the run's length and shape, the resume, the fault injection, where the losses and
the reports go, and for ``bench.hook_overhead --framework`` the run without opsd and each step's time."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path


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
    p.add_argument(
        "--no-opsd", action="store_true", help="the framework alone, without opsd (a benchmark's other side)"
    )
    p.add_argument("--step-times-out", help="each optimizer step's wall time as the framework's loop sees it (rank 0)")
    return p


class StepClock:
    """Each step's wall time, from its start to its end as the framework's own loop marks them, on either side of a
    benchmark (with opsd's callback or without): what opsd adds to a step is the difference."""

    def __init__(self) -> None:
        self.times_s: list[float] = []
        self._started: float | None = None

    def start(self) -> None:
        self._started = time.perf_counter()

    def stop(self) -> None:
        if self._started is not None:
            self.times_s.append(time.perf_counter() - self._started)
            self._started = None

    def write(self, path: str | None) -> None:
        """The times to ``path`` (JSON), from rank 0 only."""
        if path and int(os.environ.get("RANK", "0")) == 0:
            Path(path).write_text(json.dumps(self.times_s))


def lightning_options(p: argparse.ArgumentParser, framework: str) -> argparse.ArgumentParser:
    """What Lightning's ``Trainer`` example and Fabric's take beside ``common_options``: where to save, and the
    strategy (``framework`` names it in the help)."""
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument(
        "--strategy",
        choices=("ddp", "model_parallel"),
        default="ddp",
        help=f"{framework}'s strategy with 2 ranks or more: DDP, or its model-parallel one with FSDP2 over the ranks",
    )
    return p


def launch_layout() -> tuple[int, int]:
    """(ranks per node, nodes) of the launch, from torchrun's environment (``LOCAL_WORLD_SIZE``, ``WORLD_SIZE``), as
    Lightning's ``devices`` and ``num_nodes``: ``torchrun --nproc-per-node 2`` is one node of 2, ``opsd run --nodes 2
    --gpus-per-node 1`` two nodes of one (Lightning places a rank at ``GROUP_RANK x devices + LOCAL_RANK``)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return per_node, max(1, world // per_node)


class NoMonitor:
    """A Fabric loop's monitor when opsd is left out (``--no-opsd``): every call a no-op."""

    @contextlib.contextmanager
    def step(self, tokens: int) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def busy(self, what: str) -> Iterator[None]:
        yield

    def record_loss(self, loss: object) -> None:
        pass

    def resume_at(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass
