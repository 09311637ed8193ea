"""What the agent knows of the ranks of its node: the last step of each, and running totals.

Pure bookkeeping: no sockets, no clocks (``now_s`` is an argument), one lock. Ranks report per-step figures; the
totals here are sums of those, so they only ever grow (Prometheus counters). Series are bounded: at most
``max_comm_series`` (dimension, op) pairs per rank, the last of which is ``("other", "other")`` where the pairs
past the budget are added up; a rank
not heard from for ``stale_after_s`` is forgotten.

Per run, the collectives of all its ranks on the node are also summed by (phase, dimension, op), for the
controller's flame graph: cumulative since the agent started, capped the same way at ``max_comm_series`` times
the number of phases, the last being ``("other", "other", "other")``; forgotten with the run's last rank. A
dimension or op that is not a plain label (letters, digits, ``_.-``, at most 64) is counted as ``other``.
"""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass, field, replace

from opsd.protocol.wire import PHASES, ActivityReport, StepReport, TimeoutReport

OVERFLOW = ("other", "other")
RUN_OVERFLOW = ("other", "other", "other")
_LABEL = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_LABELS: dict[str, str] = {}  # name -> its label (``_label``)
_MAX_LABELS = 4096


@dataclass
class CommTotals:
    count: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class RunComms:
    """A run's collectives on this node, summed over its ranks since the agent started."""

    run: str
    phase: str
    dimension: str
    op: str
    seconds: float
    count: int
    bytes: int


@dataclass
class CheckpointTotals:
    count: int = 0
    blocking_s: float = 0.0
    staging_s: float = 0.0
    total_s: float = 0.0
    bytes: int = 0


@dataclass
class FtTotals:
    """A rank of a fault-tolerant replica group: its heals, the seconds they took, the seconds it waited for a
    quorum, and the steps whose update was discarded, summed over its reports."""

    heals: int = 0
    healing_s: float = 0.0
    quorum_wait_s: float = 0.0
    discarded_steps: int = 0


@dataclass
class RankState:
    run: str
    rank: int
    last: StepReport  # the last report
    steps_total: int = 0
    tokens_total: int = 0
    compute_total_s: float = 0.0  # sum of the steps' compute_s (straggler scoring takes its differences)
    comms: dict[tuple[str, str], CommTotals] = field(default_factory=dict)
    last_seen_s: float = 0.0
    checkpoints: CheckpointTotals = field(default_factory=lambda: CheckpointTotals())
    ft: FtTotals | None = None  # once it reported a quorum
    comm_host_timed_s: float = 0.0  # of the collectives' seconds, those timed on the host where the GPU's were refused


@dataclass(frozen=True)
class RankSnapshot:
    run: str
    rank: int
    host: str
    coords: dict[str, int]
    last: StepReport
    steps_total: int
    tokens_total: int
    compute_total_s: float
    comms: dict[tuple[str, str], CommTotals]
    last_seen_s: float
    checkpoints: CheckpointTotals
    ft: FtTotals | None = None
    comm_host_timed_s: float = 0.0


class NodeState:
    def __init__(self, *, max_comm_series: int = 8, stale_after_s: float = 600.0) -> None:
        if max_comm_series < 1:
            raise ValueError("state.max_comm_series must be >= 1")
        if stale_after_s <= 0:
            raise ValueError("state.stale_after_s must be > 0")
        self.max_comm_series = max_comm_series
        self.max_run_comm_series = max_comm_series * len(PHASES)
        self.stale_after_s = stale_after_s
        self._ranks: dict[tuple[str, int], RankState] = {}
        self._run_comms: dict[str, dict[tuple[str, str, str], CommTotals]] = {}  # run -> (phase, dim, op) -> totals
        self._timeouts: dict[tuple[str, int], TimeoutReport] = {}  # cleared by the rank's next step report
        # what a rank said it does instead of stepping, since when (this agent's clock) and when it said it (the
        # rank's): cleared by a step it ended after that (a step sent late, once its GPU work completed, is older)
        self._activities: dict[tuple[str, int], tuple[str, float, float]] = {}
        self._lock = threading.Lock()

    def ingest_timeout(self, report: TimeoutReport) -> None:
        """A rank waits on a collective past its timeout: kept until the rank reports a step after it."""
        with self._lock:
            self._timeouts[(report.run, report.rank)] = report

    def ingest_activity(self, report: ActivityReport, now_s: float) -> None:
        """A rank says what it does instead of stepping (a checkpoint it waits for, its end), or that it trains
        again (``""``); kept, with when it said it, until its next step report or activity."""
        key = (report.run, report.rank)
        with self._lock:
            if not report.activity:
                self._activities.pop(key, None)
            elif self._activities.get(key, ("",))[0] != report.activity:
                self._activities[key] = (report.activity, now_s, report.time_unix_s)

    def activities(self) -> dict[tuple[str, int], tuple[str, float]]:
        """(run, rank) -> (what it said it does, since when), for the ranks that said one and did not step since."""
        with self._lock:
            return {k: (what, since_s) for k, (what, since_s, _) in self._activities.items()}

    def timeouts(self) -> list[TimeoutReport]:
        """The collective timeouts outstanding, by (run, rank)."""
        with self._lock:
            return [t for _, t in sorted(self._timeouts.items())]

    def ingest(self, report: StepReport, now_s: float) -> None:
        """Fold one decoded step report (see ``opsd.protocol.wire``) into the totals."""
        key = (report.run, report.rank)
        with self._lock:
            state = self._ranks.get(key)
            if state is None:
                state = self._ranks[key] = RankState(run=key[0], rank=key[1], last=report)
            state.last = report
            timeout = self._timeouts.get(key)
            if timeout is not None and report.step > timeout.step:
                del self._timeouts[key]  # the wait is over
            if self._activities and report.time_unix_s > self._activities.get(key, ("", 0.0, math.inf))[2]:
                del self._activities[key]  # it steps again
            state.steps_total += 1
            state.tokens_total += report.tokens
            state.compute_total_s += report.compute_s
            state.last_seen_s = now_s
            for ckpt in report.checkpoints:
                c = state.checkpoints
                c.count += 1
                c.blocking_s += ckpt.blocking_s
                c.staging_s += ckpt.staging_s
                c.total_s += ckpt.total_s
                c.bytes += ckpt.bytes
            if report.ft is not None:
                f = state.ft = state.ft or FtTotals()
                f.heals += report.ft.healing_s > 0
                f.healing_s += report.ft.healing_s
                f.quorum_wait_s += report.ft.quorum_wait_s
                f.discarded_steps += not report.ft.committed
            state.comm_host_timed_s += report.comm_host_timed_s
            if report.comms:
                self._fold_comms(state, self._run_comms.setdefault(report.run, {}), report)

    def _fold_comms(
        self, state: RankState, run_comms: dict[tuple[str, str, str], CommTotals], report: StepReport
    ) -> None:
        """A report's collectives into its rank's totals by (dimension, op) and its run's by (phase, dimension, op),
        each within its budget of series (the lock held). The hot path of the agent's ingest: a totals object is
        made only for a series new to it."""
        rank_comms = state.comms
        for entry in report.comms:
            dim, op, count, nbytes, seconds = entry.dimension, entry.op, entry.count, entry.bytes, entry.seconds
            pair = (dim, op)
            totals = rank_comms.get(pair)
            if totals is None:
                if len(rank_comms) >= self.max_comm_series - 1:
                    pair = OVERFLOW  # the last of the budget
                totals = rank_comms.get(pair)
                if totals is None:
                    totals = rank_comms[pair] = CommTotals()
            totals.count += count
            totals.bytes += nbytes
            totals.seconds += seconds
            stack: tuple[str, str, str] = (entry.phase, _label(dim), _label(op))
            totals = run_comms.get(stack)
            if totals is None:
                if len(run_comms) >= self.max_run_comm_series - 1:
                    stack = RUN_OVERFLOW  # the last of the budget
                totals = run_comms.get(stack)
                if totals is None:
                    totals = run_comms[stack] = CommTotals()
            totals.count += count
            totals.bytes += nbytes
            totals.seconds += seconds

    def expire(self, now_s: float) -> list[tuple[str, int]]:
        """Forget the ranks not heard from for ``stale_after_s``; the (run, rank) pairs forgotten."""
        with self._lock:
            gone = [k for k, s in self._ranks.items() if now_s - s.last_seen_s > self.stale_after_s]
            for k in gone:
                del self._ranks[k]
                self._timeouts.pop(k, None)
                self._activities.pop(k, None)
            if gone:
                running = {run for run, _ in self._ranks}
                for run in [r for r in self._run_comms if r not in running]:
                    del self._run_comms[run]
        return gone

    def run_comms(self) -> list[RunComms]:
        """Every run's collective totals on this node by (phase, dimension, op), ordered."""
        with self._lock:
            return [
                RunComms(run, phase, dim, op, t.seconds, t.count, t.bytes)
                for run, totals in sorted(self._run_comms.items())
                for (phase, dim, op), t in sorted(totals.items())
            ]

    def snapshot(self) -> list[RankSnapshot]:
        """A consistent copy of every rank's state, ordered by (run, rank)."""
        with self._lock:
            return [
                RankSnapshot(
                    run=s.run,
                    rank=s.rank,
                    host=s.last.host,
                    coords=dict(s.last.coords),
                    last=s.last,
                    steps_total=s.steps_total,
                    tokens_total=s.tokens_total,
                    compute_total_s=s.compute_total_s,
                    comms={k: CommTotals(v.count, v.bytes, v.seconds) for k, v in s.comms.items()},
                    last_seen_s=s.last_seen_s,
                    checkpoints=replace(s.checkpoints),
                    ft=replace(s.ft) if s.ft is not None else None,
                    comm_host_timed_s=s.comm_host_timed_s,
                )
                for _, s in sorted(self._ranks.items())
            ]


def _label(name: str) -> str:
    """``name`` as a label value of the run's series: itself when it is a short word, else ``other`` (remembered:
    every report names the same few)."""
    label = _LABELS.get(name)
    if label is None:
        if len(_LABELS) >= _MAX_LABELS:
            _LABELS.clear()
        label = _LABELS[name] = name if _LABEL.fullmatch(name) else "other"
    return label
