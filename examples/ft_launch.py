"""Start a fault-tolerant run of the reference trainer on this machine: a Lighthouse and one job per replica group.

    python -m examples.ft_launch --nproc-per-group 2 -- --mesh dp_replicate=2,dp_shard=2 --steps 50

Each replica group (``dp_replicate`` of ``--mesh``) is a job of its own: a torchrun of ``--nproc-per-group`` ranks
(a plain process when it is one rank), with ``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS``, ``TORCHFT_LIGHTHOUSE`` and
the Manager's timeouts in its environment (``opsd.protocol.ft``). The functions are what the tests use to start,
kill and restart groups and the Lighthouse one by one; the command line starts them all and waits (docs/ft.md).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from examples import lighthouse
from opsd.protocol.ft import LighthouseConfig, ManagerTimeouts, ReplicaGroupEnv
from opsd.protocol.mesh import MeshSpec

READY_TIMEOUT_S = 60.0


def free_port() -> int:
    """A TCP port free on this machine now (the OS's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    port = port or free_port()
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
    """One replica group's job: its launcher (torchrun, or the rank itself) and what it was started with."""

    replica: ReplicaGroupEnv
    nproc: int
    proc: subprocess.Popen[bytes]
    started_unix_s: float

    def kill(self) -> None:
        """SIGKILL every process of the group (torchrun and its ranks) and reap them."""
        _kill(self.proc)


def group_command(nproc: int, train_args: Sequence[str]) -> list[str]:
    """The command of one replica group's job: torchrun of ``nproc`` ranks of ``examples.train --ft``."""
    module = ["-m", "examples.train", "--ft", *train_args]
    if nproc == 1:
        return [sys.executable, *module]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *module]


def start_group(
    replica: ReplicaGroupEnv,
    nproc: int,
    train_args: Sequence[str],
    *,
    log: IO[bytes] | None = None,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> ReplicaGroup:
    """Start replica group ``replica.group`` as a job of ``nproc`` ranks (a session of its own)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(name, None)  # the group's own world, not the launcher's
    full_env.update(replica.env())
    out = log if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen(
        group_command(nproc, train_args),
        env=full_env,
        stdout=out,
        stderr=subprocess.STDOUT,
        cwd=cwd,
        start_new_session=True,
    )
    return ReplicaGroup(replica, nproc, proc, time.time())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="examples.ft_launch", description=__doc__.splitlines()[0])
    p.add_argument("--nproc-per-group", type=int, default=1, help="ranks of each replica group")
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
    try:
        mesh = train_args[train_args.index("--mesh") + 1] if "--mesh" in train_args else ""
        groups = MeshSpec.parse(mesh).dp_replicate if "-1" not in mesh else 0
        if groups < 1:
            raise ValueError("--mesh must name dp_replicate (the replica groups) and no dp_shard=-1")
        config = LighthouseConfig(
            args.min_replicas, args.quorum_tick_ms, args.join_timeout_ms, args.heartbeat_timeout_ms
        )
        manager = ManagerTimeouts(
            timeout_s=args.timeout_s, quorum_timeout_s=args.quorum_timeout_s, quorum_retries=args.quorum_retries
        )
        lighthouse = start_lighthouse(config, args.port)
    except (ValueError, RuntimeError) as exc:
        print(f"examples.ft_launch: error: {exc}", file=sys.stderr)
        return 2
    jobs: list[ReplicaGroup] = []
    try:
        for group in range(groups):
            replica = ReplicaGroupEnv(group, groups, lighthouse.address, args.min_replicas, manager)
            jobs.append(start_group(replica, args.nproc_per_group, train_args, log=sys.stdout.buffer))
        codes = [job.proc.wait() for job in jobs]
        for job, code in zip(jobs, codes, strict=True):
            print(f"replica group {job.replica.group}: exit {code}", file=sys.stderr)
        return max(codes, key=abs)
    finally:
        for job in jobs:
            if job.proc.poll() is None:
                job.kill()
        lighthouse.kill()


if __name__ == "__main__":
    sys.exit(main())
