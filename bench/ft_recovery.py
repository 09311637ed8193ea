"""What a failed replica group costs a fault-tolerant job on torchft: ``python -m bench.ft_recovery``.

A job of 2 replica groups (``--nproc-per-group`` ranks each, 1 by default: one process per group, the cheapest
start) of the reference trainer. In each round group 1 is SIGKILLed once both groups have trained
``--steps-together`` steps together, then started again at once; it heals from group 0 and the round ends a few
steps later. The Lighthouse's heartbeat timeout is the knob under test: the rounds take turns over
``--heartbeat-timeouts-ms`` (the order rotates every repetition), each with a Lighthouse of its own. Figures of
each round, from the ranks' own step reports:

- ``stall_s``: the survivor's longest time between two committed steps from the kill to the heal (its step in
  flight fails at once, then it waits for a quorum until the Lighthouse stops counting the dead group alive);
- ``heal_s``: from the restarted group's start to its first step in the quorum (process start, ``import torch``,
  the model, the Manager, the quorum, fetching and loading the peer's state);
- ``healing_s``: of which fetching and loading the peer's state;
- ``missed_steps``: the steps the job took without group 1 (its data shard not trained in them);
- ``false_drops``: the survivor's steps outside the failure (both groups alive) that were discarded or taken
  without group 1: a live group the Lighthouse took for dead (a heartbeat timeout too short for the machine);
- the Lighthouse's start, as ``torchft_lighthouse`` (which imports torch) and as ``opsd/backends/local/lighthouse.py``
  (which loads torchft's extension alone), taking turns.

``--json PATH`` writes the medians (``bench/ft_costs.json`` holds this machine's). Last line:
``ft_stall_over_heartbeat_timeout=<median over rounds of stall_s / heartbeat timeout>``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from examples.ft_launch import (
    ReplicaGroup,
    longest_gap,
    start_group,
    start_lighthouse,
    step_reports,
)
from opsd.backends.local import lighthouse
from opsd.backends.local.processes import listen_port
from opsd.protocol.ft import LIGHTHOUSE_COMMAND, LighthouseConfig, ManagerTimeouts, ReplicaGroupEnv
from opsd.protocol.wire import StepReport

MODEL = ("--dim", "32", "--layers", "2", "--seq-len", "16")
WAIT_S = 300.0


def _wait(what: str, done: Callable[[], bool], groups: Sequence[ReplicaGroup]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        for g in groups:
            if g.poll() not in (None, 0):
                raise RuntimeError(f"{what}: group {g.replica.group} exited {g.poll()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {WAIT_S} s")
        time.sleep(0.02)


def one_round(root: Path, heartbeat_ms: int, nproc: int, together_steps: int) -> dict[str, float]:
    """Kill group 1 of a running job, start it again, and measure (see the module's docstring)."""
    root.mkdir(parents=True)
    config = LighthouseConfig(min_replicas=1, heartbeat_timeout_ms=heartbeat_ms)
    lh = start_lighthouse(config, log=(root / "lighthouse.log").open("wb"))
    timeouts = ManagerTimeouts(timeout_s=30, quorum_timeout_s=60)
    mesh = "dp_replicate=2" + (f",dp_shard={nproc}" if nproc > 1 else "")
    argv = [
        *("--mesh", mesh, "--steps", "1000000", "--steps-file", str(root / "last-step"), *MODEL),
        *("--opsd-monitor", "--opsd-jsonl", str(root / "rank{rank}.jsonl")),
    ]
    groups: dict[int, ReplicaGroup] = {}

    def start(g: int) -> float:
        replica = ReplicaGroupEnv(g, 2, lh.address, 1, timeouts)
        groups[g] = start_group(replica, nproc, argv, log=(root / f"group{g}.log").open("ab"))
        return groups[g].started_unix_s

    def last(g: int) -> StepReport | None:
        found = step_reports(root / f"rank{g * nproc}.jsonl")
        return found[-1] if found else None

    def together(since: float) -> bool:
        reports = [last(g) for g in (0, 1)]
        return all(r is not None and r.time_unix_s > since and r.ft and r.ft.quorum_replicas == 2 for r in reports)

    try:
        start(0)
        start(1)
        _wait("both groups together", lambda: together(0.0), list(groups.values()))
        joined = time.time()
        before = last(1)
        assert before is not None
        target = before.step + together_steps
        _wait("group 1 a few steps on", lambda: (r := last(1)) is not None and r.step >= target, list(groups.values()))
        killed = time.time()  # before the kill: the survivor's step in flight fails as soon as it is done
        groups[1].kill()
        killed_step = last(1)
        assert killed_step is not None
        restarted = start(1)
        _wait("group 1 healed", lambda: together(restarted), list(groups.values()))
        healed = next(r for r in step_reports(root / f"rank{nproc}.jsonl") if r.time_unix_s > restarted)
        assert healed.ft is not None
        survivor = step_reports(root / "rank0.jsonl")
        (root / "last-step").write_text(str(max(r.step for r in survivor) + 3))
        for g in groups.values():
            if g.wait(WAIT_S) != 0:
                raise RuntimeError(f"group {g.replica.group} failed: see {root}")
        alive = [r for r in survivor if joined < r.time_unix_s < killed or r.time_unix_s > healed.time_unix_s + 0.5]
        false_drops = [r for r in alive if r.ft is not None and (not r.ft.committed or r.ft.quorum_replicas < 2)]
        return {
            "stall_s": longest_gap(survivor, killed, healed.time_unix_s),
            "heal_s": healed.time_unix_s - restarted,
            "healing_s": healed.ft.healing_s,
            "missed_steps": float(healed.step - 1 - killed_step.step),
            "false_drops": float(len(false_drops)),
        }
    finally:
        for g in groups.values():
            g.kill()
        lh.kill()


def lighthouse_start_s(console_script: bool) -> float:
    """Seconds from starting a Lighthouse to its first accepted connection."""
    port = listen_port()
    argv = LighthouseConfig().argv(port, command=lighthouse.__file__)
    if console_script:
        argv[0] = str(Path(sys.executable).parent / LIGHTHOUSE_COMMAND)
    else:
        argv.insert(0, sys.executable)
    started = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                    return time.perf_counter() - started
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(f"the Lighthouse exited with {proc.returncode}") from None
                time.sleep(0.01)
    finally:
        proc.kill()
        proc.wait()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.ft_recovery", description=__doc__.splitlines()[0])
    p.add_argument("--heartbeat-timeouts-ms", default="500,1000,2000,5000", help="the Lighthouse's, comma-separated")
    p.add_argument("--repeats", type=int, default=2, help="rounds of each heartbeat timeout")
    p.add_argument("--nproc-per-group", type=int, default=1)
    p.add_argument("--steps-together", type=int, default=200, help="steps both groups train before the kill")
    p.add_argument("--json", type=Path, help="write the medians here")
    args = p.parse_args(argv)
    timeouts_ms = [int(v) for v in args.heartbeat_timeouts_ms.split(",")]
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    starts: dict[str, list[float]] = {"torchft_lighthouse": [], "opsd/backends/local/lighthouse.py": []}
    for i in range(3):
        for console in (i % 2 == 0, i % 2 == 1):
            name = "torchft_lighthouse" if console else "opsd/backends/local/lighthouse.py"
            starts[name].append(lighthouse_start_s(console))
    for name, values in starts.items():
        print(f"lighthouse start, {name}: median {statistics.median(values):.2f} s of {values}", flush=True)

    rounds: dict[int, list[dict[str, float]]] = {t: [] for t in timeouts_ms}
    with tempfile.TemporaryDirectory(prefix="ft-recovery-") as tmp:
        for rep in range(args.repeats):
            order = timeouts_ms[rep % len(timeouts_ms) :] + timeouts_ms[: rep % len(timeouts_ms)]
            for t in order:
                figures = one_round(Path(tmp) / f"r{rep}-hb{t}", t, args.nproc_per_group, args.steps_together)
                rounds[t].append(figures)
                print(f"heartbeat timeout {t} ms: " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()), flush=True)
    summary: dict[str, Any] = {"lighthouse_start_s": {k: statistics.median(v) for k, v in starts.items()}}
    ratios = []
    for t, results in rounds.items():
        medians = {k: statistics.median(r[k] for r in results) for k in results[0]}
        summary[f"heartbeat_timeout_{t}ms"] = medians
        ratios += [r["stall_s"] / (t / 1000) for r in results]
        print(f"heartbeat timeout {t} ms, medians: " + ", ".join(f"{k} {v:.2f}" for k, v in medians.items()))
    load = os.getloadavg()
    summary["source"] = (
        f"bench.ft_recovery, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores, groups of "
        f"{args.nproc_per_group} rank(s), load average {load[0]:.1f} at the end"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"ft_stall_over_heartbeat_timeout={statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
