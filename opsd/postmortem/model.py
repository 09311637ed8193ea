"""The post-mortem report: what ``opsd.postmortem.build`` makes of the controller's bundle and
``opsd.postmortem.render`` writes out. Frozen data, and the words the report uses for kinds, actions and times."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime

from opsd.policy.goodput import BADPUT
from opsd.protocol.answers import CheckpointEntry, Mtbf
from opsd.protocol.flight_analysis import Collective, FlightAnalysis
from opsd.protocol.states import WARNING_KINDS, ActionKind

KIND_WORDS = {
    "heartbeat_loss": "node lost (no heartbeats)",
    "fatal_xid": "fatal GPU error (XID)",
    "application_xid": "application GPU error (XID)",
    "process_exit": "rank process exited",
    "hang": "hang (no step progress)",
    "collective_timeout": "collective timeout",
    "straggler": "straggler warning",
    "controller_restart": "controller restart",
    "manual_restart": "manual restart",
}
XID_ACTION_WORDS = {
    "cordon_and_swap": "a hardware fault: cordon the node and swap in a spare",
    "restart_job": "an application error: restart the job on the same nodes",
    "watch_window": "benign alone: escalated to a swap when it repeats",
}
PHASE_NAMES: dict[str, str] = {
    ActionKind.DUMP: "dump",
    ActionKind.STOP: "stop",
    ActionKind.CORDON: "cordon",
    ActionKind.TAKE_SPARE: "swap",
    ActionKind.LAUNCH: "relaunch",
}
BADPUT_BUCKETS = tuple(str(b) for b in BADPUT)


# -- the report -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Phase:
    """One phase of a recovery, in seconds after the failure (``end_s`` None: not over)."""

    name: str  # failure | detection | dump | stop | cordon | swap | relaunch | first step | another action's kind
    start_s: float | None
    end_s: float | None
    detail: str

    @property
    def duration_s(self) -> float | None:
        return None if self.start_s is None or self.end_s is None else max(0.0, self.end_s - self.start_s)


@dataclass(frozen=True)
class XidFacts:
    code: int
    gpu: int
    node: str
    meaning: str
    action: str | None  # cordon_and_swap | restart_job | watch_window, from the bundle's xid_table


@dataclass(frozen=True)
class ExitFacts:
    rank: int | None
    exit_code: int | None
    signal_name: str | None  # -9 (or 137 = 128 + 9, as shells report it): SIGKILL


def describe(c: Collective) -> str:
    """A collective in words: ``all_gather #41 on dp_shard (pg 1), completed at 2026-11-21 13:51:59.8 UTC``."""
    where = f"{c.op or 'collective'} #{c.seq if c.seq is not None else '?'} on {c.group or '?'}"
    where += f" (pg {c.pg_id})" if c.pg_id is not None else ""
    when = f" at {clock(c.time_unix_s)}" if c.time_unix_s is not None else ""
    took = f" in {c.duration_s * 1e3:.3g} ms on the GPU" if c.duration_s is not None else ""
    return f"{where}, {c.state or 'state unknown'}{took}{when}"


@dataclass(frozen=True)
class RootCause:
    kind: str
    words: str  # the kind in words
    node: str
    rank: int | None
    summary: str  # one sentence
    xid: XidFacts | None = None
    exit: ExitFacts | None = None
    flight_recorder: FlightAnalysis | None = None


@dataclass(frozen=True)
class SkippedCheckpoint:
    step: int
    state: str
    problem: str


@dataclass(frozen=True)
class Resume:
    step: int | None  # None: not relaunched (yet)
    reason: str  # "step 30: the newest, step 40, was torn: no manifest"
    skipped: tuple[SkippedCheckpoint, ...]


@dataclass(frozen=True)
class IncidentReport:
    id: int
    key: str
    kind: str
    node: str
    rank: int | None
    state: str
    detail: str
    failed_unix_s: float | None
    detected_unix_s: float | None
    resumed_unix_s: float | None
    detection_delay_s: float | None
    downtime_s: float | None  # failure -> first productive step (-> the bundle's time while still open)
    lost_steps: int | None
    recompute_s: float | None
    spare: str | None
    root_cause: RootCause
    timeline: tuple[Phase, ...]
    resume: Resume
    launch: int | None = None  # the launch that failed
    collectives: tuple[tuple[str, float], ...] = ()  # its longest collective stacks: ("phase;dimension;op", s)
    trace_id: str | None = None  # its OpenTelemetry trace, when the controller exported one (docs/tracing.md)
    replica_group: int | None = None  # a replica recovery's group (the other groups trained on; docs/ft.md)
    missed_steps: int | None = None  # the steps the other groups made while it was out
    stall_s: float | None = None  # the longest the other groups waited for a quorum meanwhile

    @property
    def is_failure(self) -> bool:
        return self.kind not in WARNING_KINDS


@dataclass(frozen=True)
class StragglerWarning:
    incident_id: int
    time_unix_s: float | None
    rank: int | None
    node: str
    slowdown_ratio: float | None
    detail: str


@dataclass(frozen=True)
class PipelineBubble:
    """A pipelined run's bubble (docs/pipeline.md): measured, and the theory of its schedule when known."""

    bubble_ratio: float
    theoretical_ratio: float | None
    schedule: str
    stages: int | None
    micro_batches: int | None
    launch: int | None  # the launch it was last measured in; None: live, the ranks' last steps
    average_ratio: float | None  # over every sample recorded while the ranks progressed


@dataclass(frozen=True)
class Goodput:
    ettr: float | None
    badput_s: tuple[tuple[str, float], ...]  # (bucket, seconds), in BADPUT_BUCKETS' order, then any other
    mtbf: Mtbf
    mfu_ratio: float | None  # live: the ranks' last steps (None or 0 once the run is over)
    tokens_per_s: float | None
    checkpoint_saves: int | None
    checkpoint_blocking_mean_s: float | None
    checkpoint_blocking_max_s: float | None
    mfu_last: float | None = None  # the last sample recorded, of launch ``last_launch``
    tokens_per_s_last: float | None = None
    last_launch: int | None = None
    mfu_average: float | None = None  # over every sample taken while the ranks progressed
    tokens_per_s_average: float | None = None
    pipeline: PipelineBubble | None = None


@dataclass(frozen=True)
class Totals:
    interruptions: int
    straggler_warnings: int
    by_kind: tuple[tuple[str, int], ...]
    downtime_s: float
    detection_s: float
    lost_steps: int
    recompute_s: float | None


@dataclass(frozen=True)
class Report:
    run_id: str
    run_state: str | None
    generated_unix_s: float
    created_unix_s: float | None
    updated_unix_s: float | None
    generation: int | None
    last_step: int | None
    final_step: int | None
    incident_id: int | None  # the incident reported on; None: the whole run
    incidents: tuple[IncidentReport, ...]  # that one, or every incident of the run (straggler warnings included)
    totals: Totals | None  # the whole run only
    goodput: Goodput
    stragglers: tuple[StragglerWarning, ...]
    checkpoints: tuple[CheckpointEntry, ...]  # oldest first
    cordoned: tuple[tuple[str, str], ...]  # (node, why)
    dumps: tuple[FlightAnalysis, ...]  # Flight Recorder analyses not tied to an incident reported on

    @property
    def detailed(self) -> tuple[IncidentReport, ...]:
        """The incidents that get a section of their own: the one asked for, or every interruption."""
        if self.incident_id is not None:
            return self.incidents
        return tuple(i for i in self.incidents if i.is_failure)


# -- words ------------------------------------------------------------------------------------------------------
def clock(time_unix_s: float | None) -> str:
    """A Unix time as ``2026-11-21 10:06:40.0 UTC`` (or "?")."""
    if time_unix_s is None:
        return "?"
    try:
        moment = datetime.fromtimestamp(time_unix_s, UTC)
    except (OverflowError, OSError, ValueError):
        return f"{time_unix_s:g} (not a date)"
    return moment.strftime("%Y-%m-%d %H:%M:%S.") + f"{moment.microsecond // 100_000} UTC"


def seconds(value: float | None) -> str:
    """A duration for people: ``1.2 s``, ``3 min 20 s``, ``2 h 05 min``."""
    if value is None:
        return "?"
    if not math.isfinite(value):
        return f"{value} s"
    sign, value = ("-" if value < 0 else ""), abs(value)
    if value < 1:
        return f"{sign}{value:.2f} s"
    if value < 60:
        return f"{sign}{value:.1f} s"
    if value < 3600:
        return f"{sign}{int(value // 60)} min {int(value % 60):02d} s"
    return f"{sign}{int(value // 3600)} h {int(value % 3600 // 60):02d} min"
