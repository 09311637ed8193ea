"""The messages a rank sends its agent besides its steps: a collective it has waited on past its timeout, and what
it does when it stops stepping for a reason it knows (``opsd.protocol.wire``)."""

from __future__ import annotations

import time

from opsd.protocol.wire import VERSION, Activity, ActivityReport, TimeoutReport


def timeout_report(run: str, rank: int, host: str, step: int, dim: str, op: str, waited_s: float) -> TimeoutReport:
    """Rank ``rank`` has waited ``waited_s`` on ``op`` over ``dim`` after ``step`` steps."""
    return TimeoutReport(
        v=VERSION,
        kind="collective_timeout",
        run=run,
        rank=rank,
        host=host,
        step=step,
        time_unix_s=time.time(),
        dim=dim,
        op=op,
        waited_s=waited_s,
    )


def activity_report(run: str, rank: int, host: str, what: Activity) -> ActivityReport:
    """Rank ``rank`` does ``what`` instead of stepping from now (``""``: it trains again)."""
    return ActivityReport(
        v=VERSION, kind="activity", run=run, rank=rank, host=host, time_unix_s=time.time(), activity=what
    )
