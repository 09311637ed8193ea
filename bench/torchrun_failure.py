"""What torchrun says about a failed job, read from its stderr: the root cause (first observed failure).

When a rank fails, ``torch.distributed.run`` prints a block like this one (``torch.distributed.elastic``'s
``ChildFailedError``) and exits 1::

    Root Cause (first observed failure):
    [0]:
      time      : 2026-05-09_02:16:35
      host      : node-0
      rank      : 1 (local_rank: 1)
      exitcode  : -6 (pid: 7652)
      error_file: <N/A>
      traceback : Signal 6 (SIGABRT) received by PID 7652

The failure is judged from that block only: which rank failed first, with which exit code (negative: the signal
that killed it), and its error line; never from a signal number found anywhere else in the output (a rank that
logs ``exitcode: -6`` of some other process is not a crash).
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

ROOT_CAUSE_HEADER = "Root Cause (first observed failure):"
_FIELD = re.compile(r"^\s{2}(\w+)\s*:\s?(.*)$")
_RANK = re.compile(r"^(\d+) \(local_rank: (\d+)\)$")
_EXITCODE = re.compile(r"^(-?\d+) \(pid: (\d+)\)")


@dataclass(frozen=True)
class RootCause:
    """The first rank that failed, as torchrun reports it."""

    rank: int
    local_rank: int
    exitcode: int
    pid: int
    traceback: str  # the rank's error: its Python traceback (with ``@record``) or a line about the signal

    @property
    def signal_name(self) -> str | None:
        """``SIGABRT``, ``SIGSEGV``, ... when the rank was killed by a signal; None when it exited."""
        if self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    def describe(self) -> str:
        how = self.signal_name or f"exit {self.exitcode}"
        return f"rank {self.rank} ({how}): {self.traceback.splitlines()[0] if self.traceback else '-'}"


def root_cause(stderr: str) -> RootCause | None:
    """The root-cause block of torchrun's stderr; None when there is none (the job succeeded, or torchrun itself
    failed before any rank did)."""
    start = stderr.rfind(ROOT_CAUSE_HEADER)
    if start < 0:
        return None
    fields: dict[str, str] = {}
    lines = stderr[start + len(ROOT_CAUSE_HEADER) :].splitlines()
    for line in lines[2:] if len(lines) > 1 and lines[1].startswith("[") else []:
        if "traceback" in fields:  # the last field: torchrun indents a traceback's later lines by two
            if not line.startswith("  "):
                break
            fields["traceback"] += "\n" + line[2:].rstrip()
            continue
        match = _FIELD.match(line)
        if match is None:
            break
        fields[match.group(1)] = match.group(2).rstrip()
    rank, exitcode = _RANK.match(fields.get("rank", "")), _EXITCODE.match(fields.get("exitcode", ""))
    if rank is None or exitcode is None:
        return None
    return RootCause(
        rank=int(rank.group(1)),
        local_rank=int(rank.group(2)),
        exitcode=int(exitcode.group(1)),
        pid=int(exitcode.group(2)),
        traceback=fields.get("traceback", "").rstrip(),
    )


def outcome(returncode: int, stderr: str) -> str:
    """One word for how a launch ended: ``ok``, the root cause's signal (``SIGABRT``, ``SIGSEGV``, ...) or
    ``exit N`` of the failing rank, or ``exit N`` of the launcher itself when it printed no root cause."""
    if returncode == 0:
        return "ok"
    if returncode < 0:  # the launched process itself (one rank, no torchrun) died of a signal
        return RootCause(0, 0, returncode, 0, "").signal_name or f"exit {returncode}"
    cause = root_cause(stderr)
    if cause is None:
        return f"exit {returncode}"
    return cause.signal_name or f"exit {cause.exitcode}"
