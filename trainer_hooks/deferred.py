"""Step reports that wait for the GPU without waiting on it.

On a GPU the training thread only queues work: a step's kernels, its collectives and its loss are done later, and
reading any of them at the end of the step (``torch.cuda.synchronize()``, ``float(loss)``) makes the host wait for
the device and loses the overlap of one step's GPU work with the next step's launches. So on CUDA the monitor
records a CUDA event on the current stream at the start and at the end of each step, copies the loss to pinned host
memory without blocking before the end event, and keeps the step as a ``PendingStep``. The step is reported once it
is complete, usually during the next step or the one after: its end event has completed (``query()``, never
``synchronize()``) and every one of its GPU-timed collectives has reported its duration through the process group's
completion hook (``StepComms.gpu_pending``). Then the step time is the time between its two events on the GPU, the
loss is read from host memory, and the collectives are those the step issued, whenever their durations came.

``PendingSteps`` keeps them in order and hands out the ones complete, oldest first (a report never overtakes an
older one). A step still incomplete is handed out as it is (its host time for its step time; counted by the monitor)
once it has waited ``max_wait_s`` since its end, and ``WAIT_STEPS`` times its own host time (a long step's kernels
may run that long after the host launched them), or when ``max_steps`` newer ones wait behind it (a bound on
memory). Bounded by time first: NCCL's watchdog fires the completion hooks at its own pace (it sleeps ~100 ms
between its looks), so steps of a few milliseconds would be forced out by a count alone. On CPU no events are
recorded: a step is complete as soon as its collectives are (at once on gloo), and is reported at its end, with its
host time, as before.

The events are anything with CUDA events' ``record``, ``query``, ``elapsed_time`` (milliseconds) and
``synchronize`` (used only when the monitor closes): the tests drive a fake whose events complete when told.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from opsd.protocol.wire import FtReport
from trainer_hooks.comm_tables import StepComms


class DeviceEvent(Protocol):
    """What the monitor uses of ``torch.cuda.Event``."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end_event: Any) -> float: ...

    def synchronize(self) -> None: ...


EventFactory = Callable[[], DeviceEvent]


def cuda_event() -> DeviceEvent:
    """A CUDA event that keeps its time (recorded on the current stream of the current device)."""
    event: DeviceEvent = torch.cuda.Event(enable_timing=True)
    return event


def stage_loss(loss: float | torch.Tensor) -> float | torch.Tensor:
    """The loss where the host can read it once the step's end event completed: a device tensor is copied, without
    blocking, to pinned host memory (queued on the current stream, before the end event is recorded)."""
    if not isinstance(loss, torch.Tensor) or loss.device.type == "cpu":
        return loss
    host = torch.empty(loss.shape, dtype=loss.dtype, pin_memory=True)
    host.copy_(loss.detach(), non_blocking=True)
    return host


@dataclass
class PendingStep:
    """A step ended on the host and not reported yet: what its report is built from."""

    step: int
    tokens: int
    host_s: float  # its time on the host, from begin to end: the step time when no events were recorded
    time_unix_s: float
    comms: StepComms
    memory: dict[str, int]
    begin: DeviceEvent | None = None
    end: DeviceEvent | None = None
    loss: float | torch.Tensor | None = None
    quorum: FtReport | None = None  # a fault-tolerant rank's: the step's quorum (``Monitor.record_quorum``)
    ended_s: float = 0.0  # when it ended on the host (``time.monotonic``)

    def complete(self) -> bool:
        """Every figure of the step is in: its end event completed, its collectives' durations arrived."""
        return self.comms.gpu_pending == 0 and (self.end is None or bool(self.end.query()))

    def step_s(self) -> float:
        """The time between the step's events on the device once they completed, else its host time."""
        if self.begin is not None and self.end is not None and self.end.query():
            return max(float(self.begin.elapsed_time(self.end)) / 1000.0, 0.0)
        return self.host_s


#: an incomplete step waits at least this many times its own host time before it is handed out as it is
WAIT_STEPS = 4


class PendingSteps:
    """Steps awaiting their report, oldest first; ``ready()`` hands out those that can go, in order."""

    def __init__(self, max_steps: int, max_wait_s: float = 5.0) -> None:
        if max_steps < 1:
            raise ValueError("monitor.max_pending_steps must be >= 1")
        if max_wait_s < 0:
            raise ValueError("monitor.max_pending_s must be >= 0")
        self.max_steps = max_steps
        self.max_wait_s = max_wait_s
        self.incomplete = 0  # steps handed out before they were complete (too many newer ones behind them)
        self._steps: deque[PendingStep] = deque()

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, step: PendingStep) -> None:
        self._steps.append(step)

    def ready(self, now_s: float) -> list[PendingStep]:
        """The oldest steps that are complete, up to the first that is not; and, past it, the oldest that waited
        too long (at ``now_s``, ``time.monotonic``), or as many of them as keep at most ``max_steps`` waiting."""
        out = []
        while self._steps and (
            self._steps[0].complete() or len(self._steps) > self.max_steps or self._overdue(self._steps[0], now_s)
        ):
            step = self._steps.popleft()
            if not step.complete():
                self.incomplete += 1
            out.append(step)
        return out

    def _overdue(self, step: PendingStep, now_s: float) -> bool:
        return now_s - step.ended_s > max(self.max_wait_s, WAIT_STEPS * step.host_s)

    def drain(self) -> list[PendingStep]:
        """Every step still waiting, after waiting for its events (the monitor is closing: blocking is allowed)."""
        for step in self._steps:
            if step.end is not None:
                step.end.synchronize()
        out = list(self._steps)
        self.incomplete += sum(1 for step in out if not step.complete())
        self._steps.clear()
        return out
