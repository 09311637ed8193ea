"""Fault-tolerant replica groups: which failures cost one replica group, and which the whole job.

A fault-tolerant run (``ReplicaGroups.groups`` > 1) trains each ``dp_replicate`` replica group as a launch of its
own, and the groups agree on a quorum at every step (torchft, docs/ft.md): when a group fails, the others go on
stepping without it, and a relaunched group heals from a live one. So a failure confined to one group is recovered
in that group alone (``recovery_scope``): its nodes quarantined and swapped as the failure asks, its ranks stopped
and relaunched; the other groups never stop. The whole job is stopped and relaunched from its last checkpoint, as a
run without groups is, when:

- the failure names no group (a controller that took the run up, an operator's restart, a hang of every group);
- a group found no quorum (``NO_QUORUM``: too few groups were alive for too long; its peers will find none either);
- the groups left could not keep a quorum: fewer than ``min_replicas`` would be alive without the failed group.

With no spare for a failed group's node the run goes on elastically with the groups it has (its ranks stopped, it
waits out of the quorum), and the group is relaunched, and heals, once a node comes back or a spare appears.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from opsd.policy.detection import Failure, FailureKind

#: failures that stop the whole job whatever the groups (they name no single group, or every group is stuck)
WHOLE_JOB = frozenset({FailureKind.CONTROLLER_RESTART, FailureKind.MANUAL_RESTART, FailureKind.NO_QUORUM})


@dataclass(frozen=True)
class ReplicaGroups:
    """The replica groups of a run: ``groups`` launches of their own (1: not fault tolerant), and the fewest that
    keep a quorum (the Lighthouse's ``min_replicas``)."""

    groups: int = 1
    min_replicas: int = 1

    def __post_init__(self) -> None:
        if self.groups < 1:
            raise ValueError("replica_groups must be >= 1")
        if not 1 <= self.min_replicas <= self.groups:
            raise ValueError("min_replicas must be between 1 and replica_groups")

    @property
    def fault_tolerant(self) -> bool:
        return self.groups > 1

    def group_of_node(self, index: int, nodes: int) -> int:
        """The group of the ``index``-th of a launch's ``nodes`` nodes (each group has as many, in order)."""
        if nodes % self.groups:
            raise ValueError(f"{nodes} nodes do not split into {self.groups} replica groups")
        return index // (nodes // self.groups)


@dataclass(frozen=True)
class Scope:
    """What a recovery stops and relaunches: one replica group (``group``), or the whole job (None), and why."""

    group: int | None
    why: str


def failed_group(failure: Failure, rank_groups: Mapping[int, int], node_groups: Mapping[str, int]) -> int | None:
    """The replica group a failure happened in: its rank's, else its node's; None when it names neither."""
    if failure.rank is not None and failure.rank in rank_groups:
        return rank_groups[failure.rank]
    return node_groups.get(failure.node)


def recovery_scope(failure: Failure, layout: ReplicaGroups, group: int | None, live: Iterable[int]) -> Scope:
    """One group, or the whole job, for ``failure`` in ``group`` (``failed_group``) of a run whose groups ``live``
    are in service now (the failed group among them, if it was)."""
    if not layout.fault_tolerant:
        return Scope(None, "the run has no replica groups")
    if failure.kind in WHOLE_JOB:
        return Scope(None, f"a {failure.kind.value} stops every group")
    if group is None:
        return Scope(None, "the failure is in no single replica group")
    left = len(set(live) - {group})
    if left < layout.min_replicas:
        why = f"{left} replica group(s) left, fewer than the quorum's minimum {layout.min_replicas}"
        return Scope(None, why)
    return Scope(group, f"replica group {group} alone: {left} group(s) keep training")
