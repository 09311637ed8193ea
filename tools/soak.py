"""A soak of the multi-process tests: every test that starts processes, run K times, to find the failures that come
by luck before a user does (``make soak``; ``SOAK_ARGS`` passes options).

The tests soaked are those marked ``slow`` and every test of a module that starts processes (its source names
``subprocess``, ``Popen``, ``multiprocessing``, ``run_module`` or torchrun): a module's quick tests come along, which
costs little. Each run is one pytest session over all of them from a fresh temporary directory (``--basetemp`` and
``TMPDIR`` under it), with no cache; every other run (the 2nd, 4th, ...) beside a CPU burner, one process spinning
on one core for the run's length and killed with it. Nothing is retried: a launch that a test would relaunch for a
known crash (``tests.launch.run_module_retrying``) is launched once (``OPSD_NO_RELAUNCH=1``).

After each run it names the tests that failed in it (a soak stopped early still says which). At the end it prints a
table, one row per test that failed in any run (runs, failures, the first failure's last lines) and the
count of tests that never failed, and last ``soak_failures=N``: the failed (or errored) test runs over every run.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: what a module's source says when its tests start processes
STARTS_PROCESSES = re.compile(r"\bsubprocess\b|\bPopen\b|\bmultiprocessing\b|\brun_module\b|torch\.distributed\.run")
NO_RELAUNCH_ENV = "OPSD_NO_RELAUNCH"
LAST_LINES = 6


@dataclass
class Outcome:
    """One test over the soak's runs."""

    runs: int = 0
    failures: int = 0
    first_failure: str = ""  # the last lines of its first failure's report
    failed_runs: list[int] = field(default_factory=list)


def process_modules(tests_dir: Path) -> list[str]:
    """The test modules whose source starts processes (paths relative to the repository)."""
    found = []
    for path in sorted(tests_dir.glob("test_*.py")):
        if STARTS_PROCESSES.search(path.read_text()):
            found.append(str(path.relative_to(tests_dir.parent)))
    return found


def collect(python: str, args: Sequence[str]) -> list[str]:
    """pytest's node ids for ``args`` (a selection), without running anything."""
    proc = subprocess.run(
        [python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode not in (0, 5):  # 5: nothing collected
        raise SystemExit(f"soak: collecting {' '.join(args)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return [line for line in proc.stdout.splitlines() if "::" in line and not line.startswith(" ")]


def junit_outcomes(path: Path) -> dict[str, tuple[bool, str]]:
    """Each test case of a JUnit XML report: (whether it failed or errored, the last lines of why)."""
    out: dict[str, tuple[bool, str]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        test = f"{classname}::{name}" if classname else name
        bad = [child for child in case if child.tag in ("failure", "error")]
        if case.find("skipped") is not None and not bad:
            continue
        why = ""
        if bad:
            text = (bad[0].get("message") or "") + "\n" + (bad[0].text or "")
            why = "\n".join(line for line in text.strip().splitlines()[-LAST_LINES:])
        failed = bool(bad)
        if test in out:  # a test's setup and call both reported: either failing fails it
            failed = failed or out[test][0]
            why = out[test][1] or why
        out[test] = (failed, why)
    return out


def add_run(outcomes: dict[str, Outcome], run: int, results: dict[str, tuple[bool, str]]) -> None:
    for test, (failed, why) in results.items():
        outcome = outcomes.setdefault(test, Outcome())
        outcome.runs += 1
        if failed:
            outcome.failures += 1
            outcome.failed_runs.append(run)
            outcome.first_failure = outcome.first_failure or why


def failed_in(run: int, results: dict[str, tuple[bool, str]]) -> list[str]:
    """A line per test that failed in ``run``, printed as soon as the run ends."""
    return [f"  failed in run {run}: {test}" for test, (failed, _) in sorted(results.items()) if failed]


def table(outcomes: dict[str, Outcome], burned: Iterable[int]) -> list[str]:
    """The report's lines: a row per test that failed (runs with a burner marked ``*``), the rest counted, and last
    ``soak_failures=N``."""
    burners = set(burned)
    lines = []
    failing = sorted((t for t, o in outcomes.items() if o.failures), key=lambda t: (-outcomes[t].failures, t))
    lines.append(f"{'test':<100} {'runs':>4} {'failed':>6}  runs failed (* beside a CPU burner)")
    for test in failing:
        o = outcomes[test]
        which = ", ".join(f"{r}{'*' if r in burners else ''}" for r in o.failed_runs)
        lines.append(f"{test:<100} {o.runs:>4} {o.failures:>6}  {which}")
        lines.extend(f"    | {line}" for line in o.first_failure.splitlines())
    passed = sum(1 for o in outcomes.values() if not o.failures)
    lines.append(f"{passed} of {len(outcomes)} tests never failed")
    lines.append(f"soak_failures={sum(o.failures for o in outcomes.values())}")
    return lines


def burner() -> subprocess.Popen[bytes]:
    """One process spinning on one core (killed at the end of its run)."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def soak_run(python: str, tests: Sequence[str], run: int, burn: bool, keep: Path | None) -> dict[str, tuple[bool, str]]:
    """One pytest session over ``tests`` from a fresh temporary directory; each test's outcome."""
    with tempfile.TemporaryDirectory(prefix=f"soak-{run}-") as tmp:
        base = Path(tmp)
        base.chmod(0o755)  # as /tmp is to the tests' helpers that run as another user (PostgreSQL's initdb)
        report = base / "junit.xml"
        env = {**os.environ, "TMPDIR": str(base), NO_RELAUNCH_ENV: "1"}
        cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(base / "pytest")]
        cmd += ["--junitxml", str(report), "-o", "junit_family=xunit1", *tests]
        spinning = burner() if burn else None
        started = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        finally:
            if spinning is not None:
                spinning.kill()
                spinning.wait()
        took = time.monotonic() - started
        summary = proc.stdout.strip().splitlines()[-1:] or ["(no output)"]
        print(f"run {run}{' beside a CPU burner' if burn else ''}: {summary[0]} ({took:.0f} s)", flush=True)
        if keep is not None:
            (keep / f"run-{run}.log").write_text(proc.stdout + proc.stderr)
        if not report.exists():
            raise SystemExit(f"soak: run {run} wrote no report:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        outcomes = junit_outcomes(report)
        if keep is not None and any(failed for failed, _ in outcomes.values()):
            # the failed run's files (its ranks' and agents' logs, the controllers' state) for the diagnosis; sockets,
            # pipes and the like are not files to copy (an agent's socket made copytree fail the whole soak)
            shutil.copytree(
                base / "pytest",
                keep / f"run-{run}-files",
                symlinks=True,
                ignore_dangling_symlinks=True,
                ignore=not_files,
            )
        return outcomes


def not_files(directory: str, names: list[str]) -> list[str]:
    """What ``copytree`` leaves out of ``directory``: what is neither a file, a directory nor a link (a socket)."""
    out = []
    for name in names:
        mode = os.lstat(os.path.join(directory, name)).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
            out.append(name)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of every test (K)")
    parser.add_argument("-k", dest="keyword", default="", help="only the tests pytest's -k selects")
    parser.add_argument("--list", action="store_true", help="print the tests soaked and stop")
    parser.add_argument(
        "--keep", type=Path, help="keep each run's pytest output in this folder, and a failed run's files"
    )
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    python = sys.executable
    keyword = ["-k", args.keyword] if args.keyword else []
    tests = sorted(
        set(collect(python, ["-m", "slow", *keyword]))
        | set(collect(python, [*process_modules(ROOT / "tests"), *keyword]))
    )
    if args.list:
        print("\n".join(tests))
        print(f"{len(tests)} tests")
        return 0
    if not tests:
        parser.error("no test selected")
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    print(f"soak: {len(tests)} tests, {args.runs} runs (every other one beside a CPU burner)", flush=True)
    outcomes: dict[str, Outcome] = {}
    burned = [run for run in range(1, args.runs + 1) if run % 2 == 0]
    for run in range(1, args.runs + 1):
        results = soak_run(python, tests, run, run in burned, args.keep)
        for line in failed_in(run, results):  # known at once, not only at the end
            print(line, flush=True)
        add_run(outcomes, run, results)
    print("\n".join(table(outcomes, burned)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
