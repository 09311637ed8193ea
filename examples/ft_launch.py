"""Start a fault-tolerant run of the reference trainer on this machine: a Lighthouse and one job per replica group.

    python -m examples.ft_launch --nproc-per-group 2 -- --mesh dp_replicate=2,dp_shard=2 --steps 50
    python -m examples.ft_launch --group 1 --lighthouse http://localhost:29510 --nproc-per-group 2 -- --mesh ...

Each replica group (``dp_replicate`` of ``--mesh``) is a job of its own: a world of ``--nproc-per-group`` ranks,
started as torchrun would (one process per rank with torchrun's variables), with ``REPLICA_GROUP_ID``,
``NUM_REPLICA_GROUPS``, ``TORCHFT_LIGHTHOUSE`` and the Manager's timeouts in its environment (``opsd.protocol.ft``).
The functions are what the tests use to start, kill and restart groups and the Lighthouse one by one; the command
line starts a Lighthouse and every group and waits, or (``--group``, ``--lighthouse``) one group joining a running
job, as a relaunch would (docs/ft.md).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO

from opsd.backends.local import lighthouse
from opsd.backends.local.processes import listen_port
from opsd.protocol.ft import LighthouseConfig, ManagerTimeouts, ReplicaGroupEnv
from opsd.protocol.mesh import MeshSpec
from opsd.protocol.wire import StepReport, decode_report

READY_TIMEOUT_S = 60.0


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started (torchrun's ranks run in sessions of their own), from ``/proc``."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(child) for child in (task / "children").read_text().split()]
    return found


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc``, its process group and every process it started, and reap it."""
    pids = [*_children(proc.pid), proc.pid]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@dataclass
class Lighthouse:
    """A ``torchft_lighthouse`` process bound to ``port`` on every address of this machine."""

    config: LighthouseConfig
    port: int
    proc: subprocess.Popen[bytes]

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        _kill(self.proc)


def start_lighthouse(
    config: LighthouseConfig, port: int = 0, *, log: IO[bytes] | None = None, timeout_s: float = READY_TIMEOUT_S
) -> Lighthouse:
    """Start a Lighthouse on ``port`` (0: a free one) and wait until it accepts connections."""
    port = port or listen_port()
    argv = config.argv(port, command=lighthouse.__file__)
    argv.insert(0, sys.executable)
    out = log if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return Lighthouse(config, port, proc)
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"the Lighthouse exited with {proc.returncode} ({' '.join(argv)})") from None
            if time.monotonic() > deadline:
                _kill(proc)
                raise RuntimeError(f"the Lighthouse did not listen on port {port} within {timeout_s} s") from None
            time.sleep(0.05)


@dataclass
class ReplicaGroup:
    """One replica group's job: its rank processes (each a session of its own) and what it was started with."""

    replica: ReplicaGroupEnv
    ranks: list[subprocess.Popen[bytes]]
    started_unix_s: float

    def poll(self) -> int | None:
        """None while any rank runs; then the group's exit status: the first rank's that is not 0, else 0."""
        codes = [rank.poll() for rank in self.ranks]
        if any(code is None for code in codes):
            return None
        return next((code for code in codes if code), 0)

    def wait(self, timeout_s: float | None = None) -> int:
        """Wait for every rank (``subprocess.TimeoutExpired`` past ``timeout_s``); the group's exit status."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for rank in self.ranks:
            rank.wait(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        code = self.poll()
        assert code is not None
        return code

    def kill(self) -> None:
        """SIGKILL every rank of the group (and whatever it started) and reap them."""
        for rank in self.ranks:
            _kill(rank)


def group_env(replica: ReplicaGroupEnv, rank: int, nproc: int, port: int) -> dict[str, str]:
    """The environment of one rank of a replica group: torchrun's for its group's world (rank 0 serves the
    group's store on ``port``) and the fault-tolerant job's (``opsd.protocol.ft``)."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "RUST_LOG": os.environ.get("RUST_LOG", "warn"),  # torchft's servers log every quorum at info
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    env.update(replica.env())
    return env


def start_group(
    replica: ReplicaGroupEnv,
    nproc: int,
    train_args: Sequence[str],
    *,
    log: IO[bytes] | None = None,
    env: dict[str, str] | None = None,
) -> ReplicaGroup:
    """Start replica group ``replica.group`` as a world of ``nproc`` ranks of ``examples.train --ft``: one process
    per rank with torchrun's variables (as ``opsd run``'s local backend starts ranks), each in a session of its
    own. A rank that fails leaves the others to fail in their turn (their group's collectives, or the quorum's
    timeout): a launcher that must stop the group at once kills it."""
    port = listen_port()
    out = log if log is not None else subprocess.DEVNULL
    command = [sys.executable, "-m", "examples.train", "--ft", *train_args]
    ranks = [
        subprocess.Popen(
            command,
            env={**group_env(replica, rank, nproc, port), **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for rank in range(nproc)
    ]
    return ReplicaGroup(replica, ranks, time.time())


def step_reports(path: Path) -> list[StepReport]:
    """The step reports a rank has written to its JSONL file so far (``--opsd-jsonl``), each validated as on the
    wire; a line still being written is left for the next read."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    decoded = [decode_report(line) for line in data[: data.rfind(b"\n") + 1].splitlines()]
    return [r for r in decoded if isinstance(r, StepReport)]


def longest_gap(steps: Sequence[StepReport], start: float, end: float) -> float:
    """The longest time between two committed steps of a rank (``ft.committed``), over the gaps that overlap
    [``start``, ``end``] (unix seconds): how long it stalled around something that happened then."""
    times = [r.time_unix_s for r in steps if r.ft is None or r.ft.committed]
    gaps = [b - a for a, b in itertools.pairwise(times) if b >= start and a <= end]
    return max(gaps, default=0.0)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="examples.ft_launch", description=__doc__.splitlines()[0])
    p.add_argument("--nproc-per-group", type=int, default=1, help="ranks of each replica group")
    p.add_argument("--group", type=int, help="start this replica group only (default: every group)")
    p.add_argument("--lighthouse", help="a running Lighthouse's address, http://host:port (default: start one)")
    defaults, timeouts = LighthouseConfig(), ManagerTimeouts()
    p.add_argument("--min-replicas", type=int, default=defaults.min_replicas)
    p.add_argument("--quorum-tick-ms", type=int, default=defaults.quorum_tick_ms)
    p.add_argument("--join-timeout-ms", type=int, default=defaults.join_timeout_ms)
    p.add_argument("--heartbeat-timeout-ms", type=int, default=defaults.heartbeat_timeout_ms)
    p.add_argument("--timeout-s", type=int, default=timeouts.timeout_s)
    p.add_argument("--quorum-timeout-s", type=int, default=timeouts.quorum_timeout_s)
    p.add_argument("--quorum-retries", type=int, default=timeouts.quorum_retries)
    p.add_argument("--port", type=int, default=0, help="the Lighthouse's port (0: a free one)")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- and the trainer's arguments (--mesh ...)")
    args = p.parse_args(argv)
    train_args = [a for a in args.train_args if a != "--"]
    lighthouse: Lighthouse | None = None
    try:
        mesh = train_args[train_args.index("--mesh") + 1] if "--mesh" in train_args else ""
        groups = MeshSpec.parse(mesh).dp_replicate if "-1" not in mesh else 0
        if groups < 1:
            raise ValueError("--mesh must name dp_replicate (the replica groups) and no dp_shard=-1")
        manager = ManagerTimeouts(
            timeout_s=args.timeout_s, quorum_timeout_s=args.quorum_timeout_s, quorum_retries=args.quorum_retries
        )
        chosen = range(groups) if args.group is None else [args.group]
        replicas = [
            ReplicaGroupEnv(g, groups, args.lighthouse or "http://-", args.min_replicas, manager) for g in chosen
        ]
        if args.lighthouse is None:
            config = LighthouseConfig(
                args.min_replicas, args.quorum_tick_ms, args.join_timeout_ms, args.heartbeat_timeout_ms
            )
            lighthouse = start_lighthouse(config, args.port)
            replicas = [replace(r, lighthouse=lighthouse.address) for r in replicas]
    except (ValueError, RuntimeError) as exc:
        print(f"examples.ft_launch: error: {exc}", file=sys.stderr)
        return 2
    jobs: list[ReplicaGroup] = []
    try:
        for replica in replicas:
            jobs.append(start_group(replica, args.nproc_per_group, train_args, log=sys.stdout.buffer))
        codes = [job.wait() for job in jobs]
        for job, code in zip(jobs, codes, strict=True):
            print(f"replica group {job.replica.group}: exit {code}", file=sys.stderr)
        return max(codes, key=abs)
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
        if lighthouse is not None:
            lighthouse.kill()


if __name__ == "__main__":
    sys.exit(main())
