"""The local backend's machines: each "node" is a node agent process plus the rank processes of the current launch,
all on this machine, each in a process group of its own.

Ranks get torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``) plus opsd's (``opsd.protocol.env``): the run, the node, its agent's socket, its
policy file and ``<node dir>/flight``, where the node's agent picks their Flight Recorder dumps up. Each launch (a
generation) gets a fresh rendezvous port. A node's fake GPUs are files (``opsd.protocol.gpu_files``) its agent
reads.

A controller that stops (killed, machine rebooted) leaves its agents and ranks running; their process ids and start
times are in ``<run>/processes.json``, so that the next controller of the run kills them (``kill_orphans``) and not
a process that reused a pid. A lock file (``flock``) keeps two controllers off one run.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from opsd.backends.local import lighthouse
from opsd.backends.local.spec import LocalRunSpec
from opsd.errors import PermanentError
from opsd.protocol.env import (
    AGENT_SOCKET_ENV,
    CONTROLLER_TOKEN_ENV,
    FLIGHT_DIR_ENV,
    LAUNCH_ENV,
    NODE_ENV,
    POLICY_FILE_ENV,
    RUN_ENV,
)
from opsd.protocol.ft import ReplicaGroupEnv
from opsd.protocol.gpu_files import SAMPLES_FILE, GpuSample, write_samples

log = logging.getLogger(__name__)


def kernel_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, the kernel's choice (from its ephemeral range: for a socket bound at once)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


#: where the kernel picks the ports of outgoing connections and of ``bind(port 0)`` (Linux's default when unread)
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_LISTEN_PORT = 20000


def listen_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A TCP port free on ``host`` now for a process that binds it later (a rendezvous's store, the Lighthouse):
    below the kernel's ephemeral range, so that no outgoing connection or ``bind(0)`` takes it in between (a
    port the kernel chose from inside that range was taken by one under load, and the rank 0 that bound it seconds later
    failed with EADDRINUSE)."""
    try:
        ephemeral_low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    chooser = rng or random.SystemRandom()
    for _ in range(100):
        port = chooser.randrange(LOWEST_LISTEN_PORT, max(LOWEST_LISTEN_PORT + 1, ephemeral_low))
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    return kernel_port(host)  # every one tried is taken: the kernel's choice


#: a port for a server started now and listening later: ``listen_port``
free_port = listen_port


@dataclass
class RankProcess:
    rank: int  # the job's (a fault-tolerant run's groups number their ranks on from each other's)
    node: str
    proc: subprocess.Popen[bytes]
    group: int | None = None  # its replica group, in a fault-tolerant run
    launch: int | None = None  # the launch it was started in (its OPSD_LAUNCH)
    reported_exit: bool = False


class RankExit(NamedTuple):
    """A rank process that ended, as ``LocalBackend.supervise`` reports it: its exit code, and the launch and replica
    group it was started in (a stopped group's end may be reported after the group was launched again)."""

    rank: int
    node: str
    code: int
    launch: int | None
    group: int | None


def running(proc: subprocess.Popen[bytes]) -> bool:
    """Whether ``proc`` has not exited and is not stopped (SIGSTOP: state ``T`` in ``/proc/<pid>/stat``)."""
    if proc.poll() is not None:
        return False
    try:
        stat = Path(f"/proc/{proc.pid}/stat").read_text()
    except OSError:
        return proc.poll() is None
    state = stat.rsplit(")", 1)[-1].split()[0]  # after the command's name, which may hold spaces and ')'
    return state not in ("T", "t", "Z", "X")


def lock_run(spec: LocalRunSpec) -> int:
    """One controller per run: an exclusive ``flock`` on ``<run>/controller.lock``, held until its descriptor is
    closed (or the process exits); the descriptor."""
    path = spec.root / "controller.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise PermanentError(f"run {spec.run!r} has another opsd run supervising it ({path} is locked)") from None
    return fd


def start_agent(
    spec: LocalRunSpec, node: str, extra_args: Sequence[str] = (), extra_env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start the agent of ``node`` (its fake GPUs written first, when missing); ``extra_args`` and ``extra_env`` add
    to (or override) its settings."""
    directory = spec.node_dir(node)
    gpus = directory / "gpus"
    gpus.mkdir(parents=True, exist_ok=True)
    if not (gpus / SAMPLES_FILE).exists():
        write_samples(gpus, [GpuSample(g, f"GPU-{node}-{g}", temperature_c=40.0) for g in range(spec.gpus_per_node)])
    cmd = [
        *(sys.executable, "-m", "opsd", "agent", "--socket", str(directory / "agent.sock"), "--metrics-port", "0"),
        *("--node", node, "--gpu-source", f"file:{gpus}", "--gpu-interval-s", str(spec.gpu_interval_s)),
        *("--policy-file", str(directory / "policy.json"), "--flight-dir", str(directory / "flight")),
        *("--heartbeat-interval-s", str(spec.heartbeat_interval_s), "--log-level", "WARNING"),
    ]
    if spec.controller_url:
        cmd += ["--controller-url", spec.controller_url]
    cmd += list(extra_args)
    env = {**os.environ, CONTROLLER_TOKEN_ENV: spec.token, **(extra_env or {})}
    with (directory / "agent.log").open("ab") as log_file:
        return subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)


def start_ranks(
    spec: LocalRunSpec, nodes: list[str], generation: int, *, group: int | None = None, lighthouse: str = ""
) -> list[RankProcess]:
    """Start ``generation`` of the run's ranks: ``gpus_per_node`` on each of ``nodes``, in torchrun's order. A
    fault-tolerant run's groups are worlds of their own, with torchft's variables (``lighthouse``: its address):
    every group, the nodes split evenly in order, or (``group``) that one on ``nodes``."""
    if spec.replica_groups == 1:
        return _start_world(spec, nodes, generation, first_rank=0, env={})
    per_group = spec.nodes // spec.replica_groups
    chosen = [group] if group is not None else list(range(spec.replica_groups))
    ranks = []
    for g in chosen:
        group_nodes = nodes if group is not None else nodes[g * per_group : (g + 1) * per_group]
        # a group started alone is relaunched while its peers train: it heals from them, not from a checkpoint
        replica = ReplicaGroupEnv(
            g, spec.replica_groups, lighthouse, spec.min_replicas, spec.ft_timeouts, heal_from_peer=group is not None
        )
        world = _start_world(
            spec, group_nodes, generation, first_rank=g * per_group * spec.gpus_per_node, env=replica.env(), group=g
        )
        ranks += world
    return ranks


def _start_world(
    spec: LocalRunSpec,
    nodes: list[str],
    generation: int,
    *,
    first_rank: int,
    env: Mapping[str, str],
    group: int | None = None,
) -> list[RankProcess]:
    """One torch.distributed world on ``nodes``, its own rendezvous port; its ranks known to the controller from
    ``first_rank`` on (the job's numbering)."""
    gpn = spec.gpus_per_node
    world = len(nodes) * gpn
    port = listen_port()
    ranks = []
    for i, node in enumerate(nodes):
        for local in range(gpn):
            rank = i * gpn + local
            rank_vars = rank_env(spec, node, rank=rank, local_rank=local, world=world, group_rank=i, port=port)
            rank_vars.update(env)
            rank_vars[LAUNCH_ENV] = str(generation)
            proc = start_rank(spec, node, rank_vars, f"rank{first_rank + rank}.gen{generation}.log")
            ranks.append(RankProcess(first_rank + rank, node, proc, group, generation))
    return ranks


def start_lighthouse(spec: LocalRunSpec, port: int | None = None) -> tuple[subprocess.Popen[bytes], int]:
    """A fault-tolerant run's Lighthouse (torchft's, its extension loaded without torch: ``lighthouse``) on ``port``
    of loopback (None: a free one), in a session of its own, its output in ``<run>/lighthouse.log``; and its port.
    Its address is given to the ranks once it listens (``wait_listening``)."""
    port = port if port is not None else listen_port()
    argv = [sys.executable, lighthouse.__file__, *spec.lighthouse.argv(port, host="127.0.0.1")[1:]]
    spec.root.mkdir(parents=True, exist_ok=True)
    with (spec.root / "lighthouse.log").open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, port


def wait_listening(proc: subprocess.Popen[bytes], port: int, timeout_s: float = 60.0) -> None:
    """Until ``proc`` accepts connections on loopback ``port``; ``PermanentError`` when it exits or does not."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return
        except OSError:
            if proc.poll() is not None:
                raise PermanentError(f"the Lighthouse exited with {proc.returncode}") from None
            if time.monotonic() > deadline:
                raise PermanentError(f"the Lighthouse did not listen on port {port} within {timeout_s:.0f} s") from None
            time.sleep(0.05)


def rank_env(
    spec: LocalRunSpec, node: str, *, rank: int, local_rank: int, world: int, group_rank: int, port: int
) -> dict[str, str]:
    """A rank's environment: torchrun's, and opsd's for the node it runs on (its agent's socket, policy file and
    Flight Recorder directory)."""
    directory = spec.node_dir(node)
    return {
        **os.environ,
        **spec.extra_env,
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(spec.gpus_per_node),
        "GROUP_RANK": str(group_rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        RUN_ENV: spec.run,
        NODE_ENV: node,
        AGENT_SOCKET_ENV: str(directory / "agent.sock"),
        POLICY_FILE_ENV: str(directory / "policy.json"),
        FLIGHT_DIR_ENV: str(directory / "flight"),
    }


def start_rank(spec: LocalRunSpec, node: str, env: dict[str, str], log_name: str) -> subprocess.Popen[bytes]:
    """The trainer command in a process group of its own, its output in the node's directory."""
    directory = spec.node_dir(node)
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / log_name).open("wb") as out:
        return subprocess.Popen(
            list(spec.command), env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def stop_ranks(ranks: list[RankProcess]) -> int:
    """SIGKILL every rank (and anything it started), and reap them; how many were still running. Idempotent."""
    running = [r for r in ranks if r.proc.poll() is None]
    for r in running:
        kill_group(r.proc.pid)
    for r in ranks:
        try:
            r.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.warning("rank %d (pid %d) did not die", r.rank, r.proc.pid)
        r.reported_exit = True
    return len(running)


def write_processes(
    spec: LocalRunSpec,
    generation: int,
    agents: dict[str, subprocess.Popen[bytes]],
    ranks: list[RankProcess],
    others: Mapping[str, subprocess.Popen[bytes]] | None = None,
) -> None:
    """Record every agent and rank, and the run's other processes (its Lighthouse), pid and start time, in
    ``<run>/processes.json``, atomically."""
    record = {
        "generation": generation,
        "agents": {n: [p.pid, start_time(p.pid)] for n, p in agents.items()},
        "ranks": {str(r.rank): [r.proc.pid, start_time(r.proc.pid)] for r in ranks},
        "others": {n: [p.pid, start_time(p.pid)] for n, p in (others or {}).items()},
    }
    path = spec.root / "processes.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def kill_orphans(spec: LocalRunSpec, timeout_s: float = 10.0) -> int:
    """SIGKILL the process groups a previous controller of this run recorded and that still run (the same pid *and*
    start time); returns how many."""
    path = spec.root / "processes.json"
    try:
        record = json.loads(path.read_text())
        pids = [
            int(p)
            for group in ("agents", "ranks", "others")
            for p, start in record.get(group, {}).values()
            if start is not None and start_time(int(p)) == start
        ]
    except FileNotFoundError:
        return 0
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        log.warning("run %s: %s is unreadable (%s): nothing killed", spec.run, path, exc)
        return 0
    for pid in pids:
        kill_group(pid)
    deadline = time.monotonic() + timeout_s
    while any(start_time(p) is not None for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(pids)


def kill_group(pid: int) -> None:
    """SIGKILL the process group ``pid`` leads (SIGCONT first, so that a stopped, hung, process dies too)."""
    for sig in (signal.SIGCONT, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)


def start_time(pid: int) -> int | None:
    """When a live process started (clock ticks since boot, from ``/proc/PID/stat``); None when it is gone or a
    zombie. With the pid, it names one process: pids are reused, start times with them are not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state is field 3, starttime field 22
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])
