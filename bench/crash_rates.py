"""How often a multi-rank CPU run of the reference trainer crashes, per layout: ``python -m bench.crash_rates``.

Each layout is launched ``--launches`` times under ``torchrun --standalone`` (one launch at a time, a fresh
directory each, ``--losses-out`` as the tests do), in each variant: ``plain`` (the trainer alone), ``monitor``
(``--opsd-monitor``), ``ckpt`` (an asynchronous checkpoint every step) and ``monitor+ckpt``. How a launch ended is
read from torchrun's root-cause block (``bench.torchrun_failure``): ok, killed by a signal (SIGABRT, SIGSEGV, ...),
another exit code, or a hang past ``--timeout-s``. Ranks run with ``PYTHONFAULTHANDLER=1``, so a crashing rank
prints the Python stack of every thread; with ``--keep DIR`` what a failed launch printed is kept there, with the
native stacks of a hung launch's ranks (``gdb -p``, when installed), and with ``--cores`` its ranks may dump core
there too (``ulimit -c unlimited``; the kernel's ``core_pattern`` decides the file name). ``--cpus 0`` runs each
launch on one CPU (``taskset``), which makes scheduling races likelier. docs/crash.md has the rates measured.

    python -m bench.crash_rates --launches 40 --steps 3 --layout cp+fsdp --layout fsdp --variant plain

Printed: one row per layout and variant (launches, outcomes, crash rate), then the last line
``crash_ratio=<launches killed by a signal / launches>`` over all rows.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.torchrun_failure import outcome

ROOT = Path(__file__).resolve().parents[1]

# name: (ranks, mesh). The layouts of the parity tests and of the demo.
LAYOUTS: dict[str, tuple[int, str]] = {
    "cp+fsdp": (4, "cp=2,dp_shard=2"),
    "fsdp": (4, "dp_shard=4"),
    "hsdp": (4, "dp_replicate=2,dp_shard=2"),
    "tp+fsdp": (4, "dp_shard=2,tp=2"),
    "pp+tp": (4, "pp=2,tp=2"),
    "pp+tp+fsdp": (8, "pp=2,tp=2,dp_shard=2"),
}
VARIANTS: dict[str, tuple[str, ...]] = {
    "plain": (),
    "monitor": ("--opsd-monitor",),
    "ckpt": ("--ckpt-every", "1"),
    "monitor+ckpt": ("--opsd-monitor", "--ckpt-every", "1"),
}
OK = "ok"
HANG = "hang"


def is_crash(result: str) -> bool:
    """A launch whose first failing rank was killed by a signal."""
    return result.startswith("SIG") or result.startswith("signal ")


@dataclass
class Row:
    """The outcomes of the launches of one layout in one variant."""

    layout: str
    variant: str
    outcomes: Counter[str] = field(default_factory=Counter)

    @property
    def launches(self) -> int:
        return sum(self.outcomes.values())

    @property
    def crashes(self) -> int:
        return sum(n for result, n in self.outcomes.items() if is_crash(result))

    @property
    def crash_ratio(self) -> float:
        return self.crashes / self.launches if self.launches else 0.0


def render(rows: Sequence[Row]) -> str:
    """The table: one line per row, its outcomes by kind (signals first, then other failures), its crash rate."""
    kinds = sorted({k for row in rows for k in row.outcomes if k != OK}, key=lambda k: (not is_crash(k), k))
    header = ["layout", "variant", "launches", OK, *kinds, "crash rate"]
    lines = [header]
    for row in rows:
        counts = [str(row.outcomes.get(k, 0)) for k in (OK, *kinds)]
        lines.append([row.layout, row.variant, str(row.launches), *counts, f"{row.crash_ratio:.1%}"])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines)


def crash_ratio(rows: Iterable[Row]) -> float:
    rows = list(rows)
    launches = sum(r.launches for r in rows)
    return sum(r.crashes for r in rows) / launches if launches else 0.0


def parse_layout(text: str) -> tuple[str, int, str]:
    """``NAME`` of ``LAYOUTS``, or ``NAME=RANKS:MESH`` (``cp4=4:cp=4``): the name, ranks and mesh."""
    if "=" in text and ":" in text.split("=", 1)[1]:
        name, rest = text.split("=", 1)
        ranks, mesh = rest.split(":", 1)
        if not ranks.isdigit() or int(ranks) < 1:
            raise ValueError(f"layout {text!r}: ranks must be a positive integer")
        return name, int(ranks), mesh
    if text not in LAYOUTS:
        raise ValueError(f"layout {text!r}: expected one of {', '.join(LAYOUTS)} or NAME=RANKS:MESH")
    return text, *LAYOUTS[text]


def trainer_args(mesh: str, steps: int, variant: str, work: Path) -> list[str]:
    args = ["--mesh", mesh, "--steps", str(steps), "--losses-out", str(work / "losses.json")]
    extra = VARIANTS[variant]
    if "--ckpt-every" in extra:
        args += ["--ckpt-dir", f"file://{work / 'ckpt'}"]
    return [*args, *extra]


def allow_cores() -> None:
    """``ulimit -c unlimited`` (up to the hard limit) for this process and so for the ranks it launches."""
    _, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))


def stop(proc: subprocess.Popen[str], grace_s: float = 30.0) -> tuple[str, str]:
    """Stop a torchrun launch and its ranks, and read what they printed: SIGTERM first, which torchrun passes on
    to the ranks (each in a session of its own, out of reach of a signal to torchrun's group), then SIGKILL to
    whatever is left of its group."""
    proc.terminate()
    try:
        return proc.communicate(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()


def rank_pids(launcher_pid: int) -> list[int]:
    """The processes torchrun started (its children), from ``/proc``."""
    children: list[int] = []
    for task in Path(f"/proc/{launcher_pid}/task").glob("*"):
        try:
            children += [int(pid) for pid in (task / "children").read_text().split()]
        except OSError:
            continue
    return sorted(children)


def native_stacks(pids: Iterable[int]) -> str:
    """Every thread's native stack of each process (``gdb -p``, when gdb is installed; else a line saying so)."""
    if shutil.which("gdb") is None:
        return "gdb is not installed: no native stacks\n"
    out = []
    for pid in pids:
        cmd = ["gdb", "-p", str(pid), "-batch", "-nx", "-ex", "thread apply all bt"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
            out.append(f"=== pid {pid}\n{done.stdout}{done.stderr}")
        except subprocess.TimeoutExpired:
            out.append(f"=== pid {pid}: gdb did not answer in 120 s")
    return "\n".join(out)


def launch(
    ranks: int, args: Sequence[str], work: Path, timeout_s: float, *, stacks: bool = False, cpus: str = ""
) -> tuple[str, str, str]:
    """One torchrun launch of the trainer in ``work`` (its working directory): its outcome, stdout, stderr. With
    ``stacks``, a hung launch's ranks get their native stacks written to ``work/stacks.txt`` before it is
    stopped."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    if cpus:
        cmd = ["taskset", "-c", cpus, *cmd]
    cmd += ["-m", "examples.train", *args]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", "PYTHONPATH": path}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.Popen(
        cmd,
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        if stacks:
            (work / "stacks.txt").write_text(native_stacks(rank_pids(proc.pid)))
        stdout, stderr = stop(proc)
        return HANG, stdout, stderr
    return outcome(proc.returncode, stderr), stdout, stderr


def measure(
    layouts: Sequence[tuple[str, int, str]],
    variants: Sequence[str],
    *,
    launches: int,
    steps: int,
    timeout_s: float,
    keep: Path | None,
    cpus: str = "",
) -> list[Row]:
    rows = []
    for name, ranks, mesh in layouts:
        for variant in variants:
            row = Row(name, variant)
            for i in range(launches):
                with tempfile.TemporaryDirectory(prefix="crash-rates-") as tmp:
                    work = Path(tmp)
                    start = time.monotonic()
                    args = trainer_args(mesh, steps, variant, work)
                    result, stdout, stderr = launch(ranks, args, work, timeout_s, stacks=keep is not None, cpus=cpus)
                    row.outcomes[result] += 1
                    took = time.monotonic() - start
                    print(f"{name} {variant} {i + 1}/{launches}: {result} ({took:.0f} s)", file=sys.stderr, flush=True)
                    if result != OK and keep is not None:
                        kept = keep / f"{name}-{variant}-{i + 1}"
                        kept.mkdir(parents=True, exist_ok=True)
                        (kept / "stdout.txt").write_text(stdout)
                        (kept / "stderr.txt").write_text(stderr)
                        for found in [*work.glob("core*"), *work.glob("stacks.txt")]:
                            shutil.move(found, kept / found.name)
            rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.crash_rates", description=__doc__.splitlines()[0])
    p.add_argument("--layout", action="append", help=f"{', '.join(LAYOUTS)} or NAME=RANKS:MESH (default: cp+fsdp)")
    p.add_argument("--variant", action="append", choices=sorted(VARIANTS), help="default: plain")
    p.add_argument("--launches", type=int, default=40, help="launches per layout and variant")
    p.add_argument("--steps", type=int, default=3, help="training steps per launch")
    p.add_argument("--timeout-s", type=float, default=300.0, help="a launch still running then is a hang")
    p.add_argument(
        "--keep", type=Path, help="keep what failed launches printed here (with a hung one's native stacks, by gdb)"
    )
    p.add_argument("--cpus", default="", help="run each launch on these CPUs only (taskset -c), e.g. 0: more races")
    p.add_argument("--cores", action="store_true", help="let the ranks dump core (needs --keep)")
    args = p.parse_args(argv)
    if args.launches < 1 or args.steps < 1:
        p.error("--launches and --steps must be >= 1")
    if args.cores and args.keep is None:
        p.error("--cores needs --keep")
    if args.cores:
        allow_cores()
    try:
        layouts = [parse_layout(text) for text in args.layout or ["cp+fsdp"]]
    except ValueError as exc:
        p.error(str(exc))
    rows = measure(
        layouts,
        args.variant or ["plain"],
        launches=args.launches,
        steps=args.steps,
        timeout_s=args.timeout_s,
        keep=args.keep,
        cpus=args.cpus,
    )
    print(render(rows))
    print(f"crash_ratio={crash_ratio(rows):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
