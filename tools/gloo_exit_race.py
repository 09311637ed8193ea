"""Reproduce the SIGABRT at a gloo rank's exit (docs/crash.md): a gloo worker thread that frees a collective's
work while the interpreter finalizes dies in ``pthread_exit``'s unwind, ``terminate called without an active
exception``, and the rank's exit code is lost.

``python tools/gloo_exit_race.py --launches 10`` launches a 2-rank torchrun job ``--launches`` times for each way
out, interleaved, prints how each ended (torchrun's root cause) and last ``exit_race_wrong_exits_<way>=N of M``
lines. In each job rank 0 gives up on an all-reduce it issued on a temporary (as a rank that timed out in a
collective would) and returns its own exit code, 3; rank 1 joins that all-reduce ``--join-delay-s`` later and
returns 0. The way out is ``python`` (``sys.exit(main())``: the interpreter's finalization) or ``hooks``
(``trainer_hooks.process_exit.run_and_exit``). The job is right when torchrun's root cause is rank 0's exit 3.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.torchrun_failure import root_cause  # noqa: E402 - run as a script, from anywhere

WAYS = ("python", "hooks")
EXPECTED_EXIT = 3  # rank 0's own code


def rank_body(join_delay_s: float) -> int:
    """Rank 0 gives up on an all-reduce of a temporary it issued (as a rank that timed out in a collective would)
    and returns 3; rank 1 joins it ``join_delay_s`` later, while rank 0's interpreter finalizes."""
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(64), async_op=True)  # its work and tensor are left to the gloo worker
        return EXPECTED_EXIT
    time.sleep(join_delay_s)
    dist.all_reduce(torch.ones(64))
    return 0


def launch(way: str, join_delay_s: float, workdir: Path) -> str:
    """One 2-rank job; how rank 0 ended, as torchrun's root cause says (``exit 3`` is the code it meant)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__]
    cmd += ["--rank-body", "--way", way, "--join-delay-s", str(join_delay_s)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    cause = root_cause(proc.stderr)
    if cause is None:
        return f"no root cause (torchrun exited {proc.returncode})"
    name = cause.signal_name
    said = ", terminate called without an active exception" if "terminate called without" in proc.stderr else ""
    return f"rank {cause.rank} exit {cause.exitcode}" + (f" ({name}{said})" if name else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank-body", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--way", choices=WAYS, default="python", help=argparse.SUPPRESS)
    parser.add_argument("--exit", dest="ways", action="append", choices=WAYS, help="ways out to compare")
    parser.add_argument("--launches", type=int, default=10, help="launches of each way out")
    parser.add_argument("--join-delay-s", type=float, default=0.0, help="how late rank 1 joins the all-reduce")
    args = parser.parse_args(argv)
    if args.rank_body:
        if args.way == "hooks":
            from trainer_hooks.process_exit import run_and_exit

            run_and_exit(lambda: rank_body(args.join_delay_s))
        return rank_body(args.join_delay_s)
    ways = args.ways or list(WAYS)
    wrong = dict.fromkeys(ways, 0)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.launches):
            for way in ways:  # interleaved: the machine's load is the same for both
                outcome = launch(way, args.join_delay_s, Path(tmp))
                if outcome != f"rank 0 exit {EXPECTED_EXIT}":
                    wrong[way] += 1
                print(f"launch {i + 1} ({way}): {outcome}", flush=True)
    for way in ways:
        print(f"exit_race_wrong_exits_{way}={wrong[way]} of {args.launches}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
