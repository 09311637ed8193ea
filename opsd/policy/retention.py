"""Which checkpoints to delete: keep the last K committed, every Nth, never the newest committed one.

Pure: steps in, steps out. ``committed`` are steps with a valid manifest; ``torn`` are step directories without
one. A torn checkpoint older than the newest committed one is garbage (its save died); a newer one may be a save
in progress and is kept.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Retention:
    keep_last: int = 3
    keep_every_steps: int = 0  # also keep steps that are multiples of this (0: none)

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ValueError("retention.keep_last must be >= 1 (the newest checkpoint is always kept)")
        if self.keep_every_steps < 0:
            raise ValueError("retention.keep_every_steps must be >= 0")


def select_deletions(committed: Iterable[int], torn: Iterable[int], retention: Retention) -> list[int]:
    """Steps to delete, oldest first."""
    done = sorted(set(committed))
    if not done:
        return []  # nothing is known good: delete nothing
    newest = done[-1]
    keep = set(done[-retention.keep_last :])
    if retention.keep_every_steps:
        keep |= {s for s in done if s % retention.keep_every_steps == 0}
    doomed = {s for s in done if s not in keep}
    doomed |= {s for s in set(torn) if s < newest}
    doomed.discard(newest)
    return sorted(doomed)
