"""What the framework examples (``examples.hf_trainer``, ``examples.lightning_trainer``) take alike on their command
line: the run's length and shape, the resume, the fault injection and where the losses and the reports go."""

from __future__ import annotations

import argparse


def common_options(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--resume", action="store_true", help="from the newest checkpoint of the run's directory")
    p.add_argument("--kill-at-step", type=int, default=0, help="SIGKILL rank 0 after this step (fault injection)")
    p.add_argument("--losses-out", help="each optimizer step's loss, as JSON (rank 0)")
    p.add_argument("--opsd-jsonl", help="the step reports also to this file ({rank}: the rank)")
    return p
