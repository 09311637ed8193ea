"""What opsd costs a step inside a framework: ``python -m bench.hook_overhead --framework hf|lightning|fabric``.

A framework owns its loop, so the monitor cannot be switched on and off from one step to the next as in the reference
trainer (a DDP communication hook, once registered, stays): the two sides are whole runs instead. Each run is the
framework's example (``examples.hf_trainer``, ``examples.lightning_trainer``, ``examples.fabric_loop``; 2 ranks on
gloo under torchrun, checkpoints off), with opsd's integration (its reports sent to a live Unix datagram socket, as to
an agent) or without it (``--no-opsd``), in the order A B B A A B B A ... so that neither side always runs first.
Each run writes the wall time of each of its steps as the framework's own loop marks them (``StepClock``: started
before opsd's callback, stopped after it); the first ``--warmup`` steps of a run are left out. Step ``k`` of an A run
is paired with step ``k`` of the B run beside it (A B, then B A): the figure is the median of the pairs' ratios
(with / without), which cancels the drifts of a shared machine. Last line: ``hook_overhead_<framework>_ratio=``.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from opsd.protocol.env import AGENT_SOCKET_ENV

EXAMPLES = {
    "hf": ("examples.hf_trainer", "--output-dir"),
    "lightning": ("examples.lightning_trainer", "--checkpoint-dir"),
    "fabric": ("examples.fabric_loop", "--checkpoint-dir"),
}


def is_a(i: int) -> bool:
    """Whether run ``i`` is an A: A B B A A B B A ..."""
    return (i + 1) // 2 % 2 == 0


def one_run(framework: str, on: bool, steps: int, tmp: Path, socket_path: str) -> list[float]:
    """One run of ``framework``'s example, with opsd (``on``) or without; its steps' wall times (rank 0)."""
    module, directory = EXAMPLES[framework]
    out = tmp / f"times-{os.urandom(4).hex()}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", module]
    cmd += [directory, str(tmp / "ckpt"), "--steps", str(steps), "--save-every", str(10 * steps)]
    cmd += ["--step-times-out", str(out), *([] if on else ["--no-opsd"])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", AGENT_SOCKET_ENV: socket_path}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    times: list[float] = json.loads(out.read_text())
    return times


def drain(sock: socket.socket, received: list[int]) -> None:
    """The agent's side of the socket: every report read and counted, so that sending never waits."""
    while True:
        try:
            sock.recv(1 << 16)
        except OSError:
            return
        received[0] += 1


def measure(framework: str, runs: int, steps: int, warmup: int) -> int:
    """The A/B runs and their figures, printed; 0."""
    if framework not in EXAMPLES:
        raise SystemExit(f"--framework must be one of {', '.join(['reference', *EXAMPLES])}")
    if runs < 2 or runs % 2 or steps <= warmup:
        raise SystemExit("--runs must be even and >= 2, and --steps more than --warmup")
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        path = str(tmp / "agent.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        received = [0]
        threading.Thread(target=drain, args=(sock, received), daemon=True).start()
        sides: list[tuple[bool, list[float]]] = []
        for i in range(runs):
            on = is_a(i)
            sides.append((on, one_run(framework, on, steps, tmp, path)[warmup:]))
            side = "with" if on else "without"
            print(f"run {i + 1} ({side} opsd): median step {statistics.median(sides[-1][1]):.6f} s")
        sock.close()
    ratios = []
    for first, second in zip(sides[0::2], sides[1::2], strict=True):  # A B, then B A: a pair of runs side by side
        (_, with_opsd), (_, without) = sorted([first, second], key=lambda side: not side[0])
        ratios += [a / b for a, b in zip(with_opsd, without, strict=False) if b > 0]
    with_all = [t for on, times in sides if on for t in times]
    without_all = [t for on, times in sides if not on for t in times]
    print(f"median step with opsd={statistics.median(with_all):.6f} s, without={statistics.median(without_all):.6f} s")
    print(f"reports received by the socket={received[0]}")
    print(f"hook_overhead_{framework}_ratio={statistics.median(ratios):.4f}")
    return 0
