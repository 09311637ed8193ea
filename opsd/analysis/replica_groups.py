"""The replica groups of a fault-tolerant run in the goodput simulation (``opsd.analysis.simulation``): which groups
are out of the quorum and until when, and what their absence costs.

A failure on a node is confined to the replica group the node belongs to, and opsd recovers that group alone
(docs/ft.md): the other groups stall (waiting on the failed group in their collective, then for a quorum without it,
then for a new communicator), then train on without it, a smaller quorum at the same step time. The failed group is
out for its detection, the wait for a spare and its relaunch and heal, and only its share of the job (1 / groups) is
lost meanwhile; when it is back, every group stalls once more while it reads a peer's state and a communicator is
built with it. A stop of the whole job (a fallback to a checkpoint restart, a planned stop) relaunches every group:
the shares booked past it are given back, so that no second of the wall time is counted twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from opsd.policy.goodput import BadputBucket


@dataclass
class _Out:
    """A group out of the quorum until ``back_s``, and its share's badput as booked: (bucket, start, end)."""

    back_s: float
    booked: list[tuple[BadputBucket, float, float]] = field(default_factory=list)
    rejoined: bool = False  # its return's stall was taken


class ReplicaGroups:
    """The groups of one simulated run; books their badput into ``badput`` (the run's buckets, in seconds of the
    whole job)."""

    def __init__(self, groups: int, min_replicas: int, badput: dict[BadputBucket, float]) -> None:
        self.groups = groups
        self.min_replicas = min_replicas
        self.badput = badput
        self.out: list[_Out] = []
        self.recoveries = 0

    def next_back_s(self) -> float:
        """When the next group out comes back (inf: none is out)."""
        return min((o.back_s for o in self.out if not o.rejoined), default=float("inf"))

    def rejoin(self, t: float) -> int:
        """The groups back by ``t`` rejoin the quorum (each once); how many."""
        back = [o for o in self.out if o.back_s <= t and not o.rejoined]
        for o in back:
            o.rejoined = True
        return len(back)

    def live(self, t: float) -> int:
        """The groups in the quorum at ``t``."""
        self.out = [o for o in self.out if o.back_s > t]
        return self.groups - len(self.out)

    def can_recover(self, t: float) -> bool:
        """Whether a group failing at ``t`` leaves a quorum: at least ``min_replicas`` groups besides it."""
        return self.groups > 1 and self.live(t) - 1 >= self.min_replicas

    def fail_one(self, t: float, stall_s: float, phases: tuple[tuple[BadputBucket, float], ...], end_s: float) -> float:
        """A group fails at ``t``: every group stalls ``stall_s`` (the ``quorum`` bucket), then the failed group's share
        is lost for the rest of its ``phases`` (bucket, seconds, one after the other from ``t``). Nothing is booked
        past ``end_s`` (the run's end). Returns when the others train again."""
        self.recoveries += 1
        stall_end = min(t + stall_s, end_s)
        for other in self.out:  # the whole job's stall already counts their share
            self._give_back(other, t, stall_end)
        self.badput[BadputBucket.QUORUM] += stall_end - t
        out = _Out(back_s=t + sum(length for _, length in phases))
        start = t
        for bucket, length in phases:
            lo, hi = max(start, stall_end), min(start + length, end_s)
            if hi > lo:
                out.booked.append((bucket, lo, hi))
                self.badput[bucket] += (hi - lo) / self.groups
            start += length
        self.out.append(out)
        return stall_end

    def stop_all(self, t: float) -> None:
        """The whole job stops at ``t``: every group out comes back with its relaunch."""
        for out in self.out:
            self._give_back(out, t, float("inf"))
        self.out = []

    def _give_back(self, out: _Out, start: float, end: float) -> None:
        kept: list[tuple[BadputBucket, float, float]] = []
        for bucket, lo, hi in out.booked:
            overlap = min(hi, end) - max(lo, start)
            if overlap <= 0:
                kept.append((bucket, lo, hi))
                continue
            self.badput[bucket] -= overlap / self.groups
            kept += [(bucket, a, b) for a, b in ((lo, max(lo, start)), (min(hi, end), hi)) if b > a]
        out.booked = kept
