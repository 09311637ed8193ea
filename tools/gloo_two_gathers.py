"""Two functional all-gathers in flight at once on one gloo process group corrupt the heap (torch 2.13, CPU).

Standalone (torch only), run under torchrun::

    torchrun --standalone --nproc-per-node=2 tools/gloo_two_gathers.py --iterations 20000

Each iteration issues two ``torch.distributed._functional_collectives.all_gather_tensor`` calls on the same gloo
group, as a context-parallel attention that gathers keys and then values does, and waits for both. After some
thousands of iterations a rank may die in ``malloc`` on one of the group's worker threads (``pt_gloo_runloop``):
SIGSEGV in ``tcache_get``, or SIGABRT from glibc's heap checks (``malloc_consolidate(): unaligned fastbin chunk
detected``). With ``--one-at-a-time`` every gather is waited for before the next is issued, and the same number
of gathers runs clean. See ``docs/crash.md`` for the stacks and the rates measured.

Last line (when no rank died): ``gathers_checked=<gathers whose result was checked on this rank>``.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=20_000)
    p.add_argument("--numel", type=int, default=256, help="elements each rank contributes to a gather")
    p.add_argument("--one-at-a-time", action="store_true", help="wait for each gather before issuing the next")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="gloo")
    ranks = torch.arange(world, dtype=torch.float32).repeat_interleave(args.numel)
    checked = 0
    for i in range(args.iterations):
        keys = torch.full((args.numel,), float(rank + i))
        values = torch.full((args.numel,), float(-rank - i))
        if args.one_at_a_time:
            gathered = [funcol.wait_tensor(funcol.all_gather_tensor(t, 0, group)) for t in (keys, values)]
        else:
            in_flight = [funcol.all_gather_tensor(t, 0, group) for t in (keys, values)]  # both issued, then waited
            gathered = [funcol.wait_tensor(t) for t in in_flight]
        if not (torch.equal(gathered[0], ranks + i) and torch.equal(gathered[1], -(ranks + i))):
            print(f"rank {rank}: wrong result at iteration {i}", file=sys.stderr)
            return 1
        checked += 2
    dist.destroy_process_group()
    print(f"gathers_checked={checked}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
