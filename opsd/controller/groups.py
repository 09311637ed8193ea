"""What the controller keeps of a fault-tolerant run's replica group stopped by a recovery, until it is back."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol


class _Rank(Protocol):
    @property
    def rank(self) -> int: ...
    @property
    def step(self) -> int: ...
    @property
    def progress_s(self) -> float: ...
    @property
    def quorum_wait_total_s(self) -> float: ...
    @property
    def discarded_total(self) -> int: ...
    @property
    def discarded_before(self) -> int: ...
    @property
    def discarded_changed_s(self) -> float: ...


@dataclass
class GroupDown:
    """A replica group of a fault-tolerant run stopped by a recovery: the newest step it had made, when, and what the
    other groups had waited for a quorum and discarded by then (their stall and their lost steps are what they wait
    and discard more until it is back)."""

    ended_step: int
    since_s: float
    waited_s: dict[int, float]  # rank of another group -> its quorum wait so far
    discarded: dict[int, int] = field(default_factory=dict)  # rank of another group -> its steps discarded so far
    relaunched: bool = False  # launched again: its new launch's reports are taken (it heals, then trains)

    @classmethod
    def stopped(cls, mine: Iterable[_Rank], others: Iterable[_Rank], now_s: float) -> GroupDown:
        """The group of ranks ``mine`` stopped at ``now_s``, the ``others`` training on. Their discarded steps count
        from when the group last stepped: the step in flight when it failed may have been discarded, and heard,
        before it was stopped."""
        mine, others = list(mine), list(others)
        last_s = max((r.progress_s for r in mine), default=now_s)
        return cls(
            max((r.step for r in mine), default=-1),
            now_s,
            {r.rank: r.quorum_wait_total_s for r in others},
            {r.rank: r.discarded_before if r.discarded_changed_s >= last_s else r.discarded_total for r in others},
        )
