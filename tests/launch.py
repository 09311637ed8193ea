"""Run the reference trainer (or any module) in subprocesses, under torchrun when there is more than one rank.

Each launch gets its own process group; on a timeout torchrun is stopped (it stops its ranks) and then the whole
group is killed, so a hung run fails its test quickly and leaves nothing behind to slow down the next one.

A failed launch is not launched again, except by ``run_module_retrying``, for one named and documented crash
(``KnownCrash``) that the launch's torchrun root-cause block shows, each attempt in a fresh directory, and within
``RETRY_BUDGET`` for the whole test session (``tests/conftest.py`` fails the session beyond it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from bench.crash_rates import stop
from bench.torchrun_failure import RootCause, root_cause
from tests.waiting import get_json, wait_for

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TIMEOUT_S = 240.0
STOP_GRACE_S = 20.0


class LaunchTimeoutError(AssertionError):
    """The launched command did not finish in time; carries what it printed so far."""


class KnownCrash(Enum):
    """A crash that a test may choose to launch again, by name. Each is documented in ``docs/crash.md`` with its
    stack and cause; a launch counts as one only if torchrun's root cause (the first rank to fail: its exit code
    and its error line) matches it.

    ``GLOO_CONCURRENT_COLLECTIVES``: two functional collectives in flight at once on one gloo group corrupt the
    rank's heap (torch 2.13, CPU): the rank dies of SIGSEGV or SIGABRT in ``malloc`` on a gloo worker thread. The
    reference trainer never issues such a pair since its context-parallel attention gathers keys and values in
    one collective; a test of code that still does may name this cause.
    """

    GLOO_CONCURRENT_COLLECTIVES = "gloo-concurrent-collectives"

    def matches(self, cause: RootCause) -> bool:
        signal_line = cause.traceback.startswith("Signal ")  # torchrun's line for a rank killed by a signal
        return signal_line and cause.signal_name in ("SIGSEGV", "SIGABRT")


#: set (to anything) to launch every command once: a soak (``tools/soak.py``) retries nothing
NO_RELAUNCH_ENV = "OPSD_NO_RELAUNCH"

# More relaunches than this in one test session fail the session, even when every test passed (tests/conftest.py):
# a known crash is rare by definition (docs/crash.md measures it); more than this means something changed.
RETRY_BUDGET = 2


@dataclass(frozen=True)
class Retry:
    """One relaunch: which test's launch, why (the root cause torchrun printed), and what."""

    command: str
    cause: KnownCrash
    root_cause: str


RETRIES: list[Retry] = []  # this session's relaunches, in order


def over_budget(retries: Sequence[Retry], budget: int = RETRY_BUDGET) -> str | None:
    """Why the session fails for its relaunches (one line per relaunch), or None while within ``budget``."""
    if len(retries) <= budget:
        return None
    lines = [f"{len(retries)} launches were run again, more than the budget of {budget} (tests/launch.py):"]
    lines += [f"  {r.cause.name}: {r.root_cause}; {r.command}" for r in retries]
    return "\n".join(lines)


def run_module(
    module: str,
    args: Sequence[str],
    *,
    nproc: int = 1,
    env: Mapping[str, str] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    cwd: Path = ROOT,
) -> subprocess.CompletedProcess[str]:
    """``python -m module args`` on one rank, or ``torchrun --standalone`` with ``nproc`` ranks; launched once."""
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
        stdout, stderr = stop(proc, STOP_GRACE_S)
        message = f"{' '.join(cmd)} ran past {timeout_s} s\n{stdout[-2000:]}\n{stderr[-4000:]}"
        raise LaunchTimeoutError(message) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def run_module_retrying(
    module: str,
    args: Callable[[Path], Sequence[str]],
    *,
    crash: KnownCrash,
    workdir: Path,
    nproc: int,
    env: Mapping[str, str] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    attempts: int = 2,
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Like ``run_module`` under torchrun, launched again (up to ``attempts`` launches) when torchrun's root cause
    is the known ``crash``. ``args(directory)`` gives each attempt's arguments: every output and checkpoint path
    must be under ``directory``, a new empty one per attempt (``workdir/attempt-N``), so that no attempt sees what
    a failed one wrote (a ``--resume`` would resume from it). Returns the last launch and its directory; every
    relaunch is recorded in ``RETRIES`` and warned about."""
    if nproc < 2:
        raise ValueError("run_module_retrying judges torchrun's root cause: nproc must be >= 2")
    if os.environ.get(NO_RELAUNCH_ENV):
        attempts = 1  # a soak (tools/soak.py) retries nothing
    for attempt in range(1, attempts + 1):
        directory = workdir / f"attempt-{attempt}"
        directory.mkdir(parents=True)
        proc = run_module(module, args(directory), nproc=nproc, env=env, timeout_s=timeout_s)
        cause = root_cause(proc.stderr) if proc.returncode != 0 else None
        if cause is None or not crash.matches(cause) or attempt == attempts:
            return proc, directory
        retry = Retry(f"{module} {' '.join(args(directory))}", crash, cause.describe())
        RETRIES.append(retry)
        warnings.warn(f"{crash.name} ({retry.root_cause}); launched again: {retry.command}", stacklevel=2)
    raise AssertionError("unreachable")  # pragma: no cover


def agent_until_sigterm(
    args: Sequence[str], port: int, while_running: Callable[[], None] | None = None
) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    """``opsd agent ARGS`` (its metrics on ``port``) until its ``/healthz`` answers, then ``while_running()``, then
    SIGTERM: what ``/healthz`` answered, and how the process ended."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "opsd", "agent", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        health: dict[str, Any] = wait_for(
            "answer from the agent's /healthz",
            lambda: get_json(f"http://127.0.0.1:{port}/healthz"),
            20,
            alive=proc,
            context=lambda: proc.stderr.read() if proc.stderr and proc.poll() is not None else "",
            retry_on=(OSError,),
            interval_s=0.1,
        )
        if while_running is not None:
            while_running()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    return health, subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
