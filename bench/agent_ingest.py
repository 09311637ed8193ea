"""How many rank datagrams one agent ingests per second: ``python -m bench.agent_ingest``.

Starts ``opsd agent`` as its own process, then 8 sender processes that each send realistic step reports (a
5D-parallel rank's, ~900 bytes) over the agent's Unix datagram socket as fast as the agent takes them (blocking
sends: a full socket buffer makes the sender wait, nothing is dropped). The rate is datagrams the agent counted
(its ``opsd_agent_datagrams_total``) over the time they took. Then the realistic load: 8 ranks at 10 steps/s each
for ``--load-s`` seconds, and the agent's CPU time over that wall time (share of one core, from /proc).

Last line: ``agent_ingest_per_s=<rate>``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from opsd.protocol.wire import VERSION, encode

SENDERS = 8


def step_report(rank: int, step: int) -> bytes:
    comms = [
        ["dp_shard", "all_gather", 10, 1315328, 0.031],
        ["dp_shard", "reduce_scatter", 5, 657664, 0.02],
        ["dp_replicate", "all_reduce", 5, 328832, 0.01],
        ["tp", "all_reduce", 28, 917504, 0.019],
        ["pp", "send", 2, 32768, 0.001],
        ["pp", "recv", 2, 32768, 0.004],
        ["cp", "all_gather", 8, 131072, 0.003],
        ["cp", "reduce_scatter", 8, 131072, 0.003],
        ["ep", "all_to_all", 20, 537728, 0.012],
    ]
    return encode(
        {
            "v": VERSION,
            "kind": "step",
            "run": "bench",
            "rank": rank,
            "world_size": 4096,
            "host": "node-0001",
            "step": step,
            "time_unix_s": time.time(),
            "step_s": 0.231,
            "compute_s": 0.207,
            "exposed_comm_s": 0.024,
            "overlapped_comm_s": 0.051,
            "tokens": 4096,
            "tokens_per_s": 17731.6,
            "job_tokens_per_s": 70926.4,
            "mfu_ratio": 0.41,
            "memory": {"allocated_peak_bytes": 51539607552, "reserved_peak_bytes": 60129542144},
            "coords": {"pp": 0, "dp_replicate": 1, "ep": 0, "dp_shard": 3, "cp": 1, "tp": rank % 8},
            "comms": comms,
            "dropped_reports_total": 0,
            "internal_errors_total": 0,
        }
    )


def send(path: str, rank: int, count: int, interval_s: float) -> None:
    data = step_report(rank, 1)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        next_s = time.monotonic()
        for _ in range(count):
            sock.sendto(data, path)
            if interval_s:
                next_s += interval_s
                time.sleep(max(0.0, next_s - time.monotonic()))


def received(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("opsd_agent_datagrams_total"):
                return float(line.rsplit(" ", 1)[1])
    raise RuntimeError("the agent has no opsd_agent_datagrams_total")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def wait_for(port: int, total: float, timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    while (seen := received(port)) < total and time.monotonic() < deadline:
        time.sleep(0.05)
    return seen


def run_senders(path: str, per_sender: int, interval_s: float) -> None:
    procs = [multiprocessing.Process(target=send, args=(path, rank, per_sender, interval_s)) for rank in range(SENDERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.agent_ingest", description=__doc__.splitlines()[0])
    p.add_argument("--per-sender", type=int, default=25_000, help="datagrams each sender sends flat out")
    p.add_argument("--load-s", type=float, default=10.0, help="seconds of the realistic load")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "agent.sock")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        command = ["agent", "--socket", path, "--metrics-port", str(port), "--log-level", "ERROR"]
        agent = subprocess.Popen([sys.executable, "-m", "opsd", *command], stdout=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    received(port)
                    break
                except OSError:
                    if time.monotonic() > deadline or agent.poll() is not None:
                        raise RuntimeError("the agent did not start") from None
                    time.sleep(0.1)

            # realistic load first: 8 ranks x 10 steps/s
            before_cpu, before_n, start = cpu_s(agent.pid), received(port), time.monotonic()
            run_senders(path, int(args.load_s * 10), 0.1)
            wait_for(port, before_n + SENDERS * int(args.load_s * 10), 30)
            wall = time.monotonic() - start
            share = (cpu_s(agent.pid) - before_cpu) / wall
            load = f"{SENDERS} ranks x 10 steps/s for {wall:.1f} s"
            print(f"realistic load: {load}, agent CPU {share * 100:.2f}% of one core")

            # flat out
            before_n, start = received(port), time.monotonic()
            run_senders(path, args.per_sender, 0.0)
            total = before_n + SENDERS * args.per_sender
            seen = wait_for(port, total, 120)
            elapsed = time.monotonic() - start
            print(f"flat out: {seen - before_n:.0f} of {SENDERS * args.per_sender} datagrams in {elapsed:.2f} s")
            print(f"agent_ingest_per_s={(seen - before_n) / elapsed:.0f}")
        finally:
            agent.terminate()
            agent.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
