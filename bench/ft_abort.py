"""How long the survivors of a hung replica group wait, with and without opsd's word: ``python -m bench.ft_abort``.

Each run is ``make demo-ft``'s (``opsd.cli.demo_ft``: a controller with the local backend, the Lighthouse, 2 replica
groups of 2 ranks on torchft, gloo, a spare node): at step ``--wedge-at`` group 1's ranks hang with their connections
left open (``examples.ft.wedge``: what a dead NCCL peer is to its survivors, who see no error) and an XID 79 comes on
group 1's node. opsd attributes the failure to group 1 and recovers it alone, and

- **with** opsd's word (A), the controller names group 1 failed in the run's policy and group 0 abandons its
  cross-group collective at once (``trainer_hooks.integrations.torchft``);
- **without** it (B, the trainer's ``--ft-ignore-opsd``), group 0 waits in the collective until its timeout
  (``--collective-timeout-s``, torchft's ``TORCHFT_TIMEOUT_SEC``; torchft's default is 60 s), as torchft's survivors
  do today. The controller's hang floor is set well above it: a group waiting that long would be judged hung, and
  the whole job restarted.

The figure of a run is group 0's stall: its longest time between two committed steps around the failure. The runs
take turns A B B A (``--rounds`` of two), each in a fresh directory. Printed: each run's stall, discarded steps and
verdict, the medians, and last ``abort_speedup_ratio=<median stall without / median stall with>``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from opsd.cli.demo_ft import run_demo
from opsd.protocol.ft import ManagerTimeouts

ARMS = {"with": (), "without": ("--ft-ignore-opsd",)}
#: the controller's hang floor, over the collective timeout: group 0 waiting out its timeout is not judged hung (which
#: would restart the whole job and end the run's figure)
HANG_FLOOR_FACTOR = 3


def order(rounds: int) -> list[str]:
    """A B B A, ``rounds`` times: neither arm always runs first."""
    return [arm for r in range(rounds) for arm in (("with", "without") if r % 2 == 0 else ("without", "with"))]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ft_abort", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="pairs of runs, one with opsd's word and one without")
    p.add_argument("--wedge-at", type=int, default=20, help="the step in which group 1 hangs")
    p.add_argument("--after-heal", type=int, default=5, help="steps each run makes once group 1 is back")
    p.add_argument("--collective-timeout-s", type=int, default=30, help="torchft's collective timeout")
    p.add_argument("--json", type=Path, help="write every run's figures here")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.wedge_at < 1 or args.after_heal < 1 or args.collective_timeout_s < 1:
        p.error("--rounds, --wedge-at, --after-heal and --collective-timeout-s must be >= 1")
    timeouts = ManagerTimeouts(timeout_s=args.collective_timeout_s)
    runs: list[dict[str, object]] = []
    stalls: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for i, arm in enumerate(order(args.rounds)):
        with tempfile.TemporaryDirectory(prefix=f"ft-abort-{arm}-") as tmp:
            result, _ = run_demo(
                Path(tmp),
                args.wedge_at,
                args.after_heal,
                240.0 + 2 * args.collective_timeout_s,
                trainer_args=ARMS[arm],
                ft_timeouts=timeouts,
                hang_floor_s=HANG_FLOOR_FACTOR * args.collective_timeout_s,
            )
        stall = result["survivor_stall_s"]
        ok = result["state"] == "completed" and result["whole_job_restarts"] == 0 and result["replica_group"] == 1
        runs.append({"arm": arm, **result})
        print(
            f"run {i + 1} ({arm} opsd's word): group 0 stalled {stall} s, discarded"
            f" {result['survivor_discarded_steps']} step(s); {result['state']}, whole-job restarts"
            f" {result['whole_job_restarts']}, incident in group {result['replica_group']}",
            flush=True,
        )
        if not ok or not isinstance(stall, float):
            print(f"run {i + 1} did not go as planned: no figure from it", file=sys.stderr)
            return 1
        stalls[arm].append(stall)
    if args.json is not None:
        args.json.write_text(json.dumps(runs, indent=1))
    with_s, without_s = statistics.median(stalls["with"]), statistics.median(stalls["without"])
    print(f"group 0's stall, median: {with_s:.2f} s with opsd's word, {without_s:.2f} s without")
    print(f"(collective timeout {args.collective_timeout_s} s; gloo on CPU, the hung group's connections held open)")
    print(f"abort_speedup_ratio={without_s / with_s:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
