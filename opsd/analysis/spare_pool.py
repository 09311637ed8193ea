"""The spare pool of the goodput simulation (``opsd.analysis.simulation``): failed nodes leave for repair and come
back; a swap waits for the first node back when the pool is empty."""

from __future__ import annotations

import heapq


class SparePool:
    """A pool of ``size`` spare nodes; a node taken out is repaired and back in the pool ``repair_s`` later."""

    def __init__(self, size: int, repair_s: float) -> None:
        self.free = size
        self.repair_s = repair_s
        self.repairs: list[float] = []  # when nodes in repair come back

    def take(self, at_s: float) -> float:
        """A failed node leaves at ``at_s``: the wait for a node to replace it."""
        while self.repairs and self.repairs[0] <= at_s:
            heapq.heappop(self.repairs)
            self.free += 1
        heapq.heappush(self.repairs, at_s + self.repair_s)
        if self.free > 0:
            self.free -= 1
            return 0.0
        return heapq.heappop(self.repairs) - at_s  # the first node back goes straight into the job
