"""Run the reference trainer (or any module) in subprocesses, under torchrun when there is more than one rank.

Each launch gets its own process group; on a timeout the whole group (torchrun and every rank) is killed, so a
hung run fails its test quickly and leaves nothing behind to slow down the next one."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TIMEOUT_S = 240.0


class LaunchTimeoutError(AssertionError):
    """The launched command did not finish in time; carries what it printed so far."""


# A rank of a gloo job on this 2-core machine sometimes crashes inside gloo, mid-run: SIGABRT ("terminate called
# without an active exception" when its stderr gets out; torchrun's "exitcode: -6"), and once SIGSEGV (-11). Most
# layouts see it a few times in several hundred launches; the 4-rank cp=2,dp_shard=2 parity run about once in 5
# even alone (without the monitor, so without any opsd code in the ranks), and a full suite once saw it twice in a
# row. Such a launch is run again, up to ``GLOO_CRASH_ATTEMPTS`` launches in all, each with a warning that pytest
# shows in its summary, rather than failing a test that has nothing to do with it. Nothing in opsd raises either
# signal.
GLOO_ABORT = "terminate called without an active exception"
_CRASH_EXIT = re.compile(r"exitcode\s*:\s*-(6|11)\b")
GLOO_CRASH_ATTEMPTS = 3


def aborted(stderr: str) -> bool:
    """Whether a launch died of the crash above (a rank's own message, or torchrun's report of exit code -6 or
    -11)."""
    return GLOO_ABORT in stderr or _CRASH_EXIT.search(stderr) is not None


def run_module(
    module: str,
    args: Sequence[str],
    *,
    nproc: int = 1,
    env: Mapping[str, str] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    cwd: Path = ROOT,
    retry_gloo_abort: bool = True,
    before_retry: Callable[[], None] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python -m module args`` on one rank, or ``torchrun --standalone`` with ``nproc`` ranks.

    ``before_retry`` undoes what a failed launch left behind (files it appended to) before the next."""
    proc = _run_once(module, args, nproc=nproc, env=env, timeout_s=timeout_s, cwd=cwd)
    for _ in range(GLOO_CRASH_ATTEMPTS - 1):
        if not (retry_gloo_abort and proc.returncode != 0 and aborted(proc.stderr)):
            break
        message = f"a rank crashed (SIGABRT or SIGSEGV) inside gloo; launched again: {module} {' '.join(args)}"
        warnings.warn(message, stacklevel=2)
        if before_retry is not None:
            before_retry()
        proc = _run_once(module, args, nproc=nproc, env=env, timeout_s=timeout_s, cwd=cwd)
    return proc


def _run_once(
    module: str,
    args: Sequence[str],
    *,
    nproc: int,
    env: Mapping[str, str] | None,
    timeout_s: float,
    cwd: Path,
) -> subprocess.CompletedProcess[str]:
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


def agent_until_sigterm(
    args: Sequence[str], port: int, while_running: Callable[[], None] | None = None
) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    """``opsd agent ARGS`` (its metrics on ``port``) until its ``/healthz`` answers, then ``while_running()``, then
    SIGTERM: what ``/healthz`` answered, and how the process ended."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "opsd", "agent", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    health: dict[str, Any] = json.load(r)
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                assert time.monotonic() < deadline, "the agent's /healthz never answered"
                time.sleep(0.1)
        if while_running is not None:
            while_running()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    return health, subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
