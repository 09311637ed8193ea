"""The monitor's settings (``trainer_hooks.monitor.MonitorConfig``): where its reports go, which run and launch
they are of, the peaks MFU is computed against, and its bounds."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from opsd.protocol.env import LAUNCH_ENV, RUN_ENV


def launch_from_env() -> int | None:
    """The launch the backend says this rank belongs to (``$OPSD_LAUNCH``, a count); None when unset or not one."""
    value = os.environ.get(LAUNCH_ENV, "").strip()
    return int(value) if value.isdigit() else None


@dataclass(frozen=True)
class MonitorConfig:
    """``run_id`` defaults to ``$OPSD_RUN`` (set by ``opsd run``), else "local"; ``socket_path`` defaults to
    ``$OPSD_AGENT_SOCKET`` (neither: the agent's UDP port at ``$OPSD_AGENT_HOST``, if set); ``jsonl_path`` adds
    a file sink (both may be set); ``launch``, the launch of the run the rank belongs to, defaults to
    ``$OPSD_LAUNCH`` (set by the backend; reports carry it)."""

    run_id: str = field(default_factory=lambda: os.environ.get(RUN_ENV) or "local")
    launch: int | None = field(default_factory=launch_from_env)
    peak_flops_per_s: float | None = None
    cpu_peak_flops_per_s: float | None = 1e12
    socket_path: str | None = None
    jsonl_path: str | None = None
    trace_collectives: bool = True
    collective_timeout_s: float = 300.0  # a wait on one collective longer than this is reported (0: never)
    flight_dir: str | None = None  # Flight Recorder dumps go there (default $OPSD_FLIGHT_DIR; neither: none)
    # on CUDA, a step's report waits for its events and GPU durations: at most this long (and 4 x its host time),
    # and while at most this many newer steps wait (trainer_hooks.deferred)
    max_pending_s: float = 5.0
    max_pending_steps: int = 1024
    close_wait_s: float = 2.0  # at close, how long to wait for the last steps' collective durations

    def __post_init__(self) -> None:
        if not self.run_id:
            raise ValueError("monitor.run_id must not be empty")
        if self.max_pending_steps < 1:
            raise ValueError("monitor.max_pending_steps must be >= 1")
        if self.max_pending_s < 0:
            raise ValueError("monitor.max_pending_s must be >= 0")
        if self.close_wait_s < 0:
            raise ValueError("monitor.close_wait_s must be >= 0")
        if self.collective_timeout_s < 0:
            raise ValueError("monitor.collective_timeout_s must be >= 0")
        if self.launch is not None and self.launch < 0:
            raise ValueError("monitor.launch must be >= 0")
        for name in ("peak_flops_per_s", "cpu_peak_flops_per_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"monitor.{name} must be > 0")
