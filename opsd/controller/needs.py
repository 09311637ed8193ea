"""What each of the controller's smaller parts needs of its core (``opsd.controller.core``), and nothing more: the
part is given the core typed as one of these, so that what it may touch is said here and checked (mypy). The parts
that work on most of what is in memory (``intake``, ``liveness``, ``detection``, ``progress``) take the core
itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

from opsd.controller.config import ControllerConfig
from opsd.controller.core import Recoveries
from opsd.controller.holds import Holds
from opsd.controller.live import NodeLive, RunLive, RunMemory, SlotClock
from opsd.controller.port import Backend
from opsd.controller.state import StateStore
from opsd.controller.tracing import IncidentTracing


class HasStore(Protocol):
    @property
    def store(self) -> StateStore: ...


class MaintenanceNeeds(HasStore, Protocol):
    """``opsd.controller.maintenance``: the windows, and the recovery to start once one ends."""

    @property
    def holds(self) -> Holds: ...

    @property
    def recovery(self) -> Recoveries: ...


class OperationsNeeds(HasStore, Protocol):
    """``opsd.controller.operations``: the backend an operator's request goes to, the recovery it starts."""

    @property
    def backend(self) -> Backend | None: ...

    @property
    def config(self) -> ControllerConfig: ...

    @property
    def recovery(self) -> Recoveries: ...

    @property
    def tracing(self) -> IncidentTracing: ...


class ScheduleNeeds(HasStore, Protocol):
    """``opsd.controller.schedule``: the clock, and one run's scoring at a time."""

    @property
    def clock(self) -> Callable[[], float]: ...

    @property
    def scoring_lock(self) -> threading.Lock: ...


class InMemory(HasStore, Protocol):
    """The runs' records in memory, under the core's lock."""

    @property
    def lock(self) -> AbstractContextManager[bool]: ...

    def remember(self, run: str) -> RunMemory: ...


class SilenceNeeds(InMemory, Protocol):
    """``opsd.controller.silence``: the nodes heard from, and the backend's word on a silent one."""

    @property
    def backend(self) -> Backend | None: ...

    @property
    def nodes(self) -> dict[str, NodeLive]: ...


class ScoringNeeds(InMemory, Protocol):
    """``opsd.controller.scoring``: the ranks' samples by slot, and the cadence's settings."""

    @property
    def config(self) -> ControllerConfig: ...

    @property
    def slots(self) -> SlotClock: ...

    def live_of(self, run: str) -> RunLive | None: ...


class ReadsNeeds(HasStore, Protocol):
    """``opsd.controller.reads``: what a run's status shows."""

    @property
    def config(self) -> ControllerConfig: ...

    @property
    def holds(self) -> Holds: ...

    @property
    def lock(self) -> AbstractContextManager[bool]: ...

    @property
    def memory(self) -> dict[str, RunMemory]: ...

    def live_of(self, run: str) -> RunLive | None: ...
