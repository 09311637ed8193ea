"""Run the reference trainer (or any module) in subprocesses, under torchrun when there is more than one rank.

Each launch gets its own process group; on a timeout the whole group (torchrun and every rank) is killed, so a
hung run fails its test quickly and leaves nothing behind to slow down the next one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TIMEOUT_S = 240.0


class LaunchTimeoutError(AssertionError):
    """The launched command did not finish in time; carries what it printed so far."""


def run_module(
    module: str,
    args: Sequence[str],
    *,
    nproc: int = 1,
    env: Mapping[str, str] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    cwd: Path = ROOT,
) -> subprocess.CompletedProcess[str]:
    """``python -m module args`` on one rank, or ``torchrun --standalone`` with ``nproc`` ranks."""
    cmd = [sys.executable, "-m", module, *args]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *cmd[1:]]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    full_env.pop("WORLD_SIZE", None)
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        message = f"{' '.join(cmd)} ran past {timeout_s} s\n{stdout[-2000:]}\n{stderr[-4000:]}"
        raise LaunchTimeoutError(message) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
