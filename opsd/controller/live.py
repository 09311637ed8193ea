"""What the heartbeats say, kept in the controller's memory: nodes' liveness, ranks' progress and compute samples,
and per run the sums a detection pass needs, kept as heartbeats arrive so that a pass does not go over every rank
(24,576 at Llama 3 scale).

Nothing here is durable: it is rebuilt within a few heartbeats after a restart. The controller guards it with its
lock. Histories of numbers are ``Window``s, rings of doubles: millions of values, and nothing in them for the
garbage collector to visit (Python floats in deques would be millions of references for each full collection to
follow at 24,576 ranks).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Any, overload

from opsd.controller.groups import GroupDown
from opsd.policy.cadence import Cadence
from opsd.policy.detection import AgentDown, GpuEvent
from opsd.policy.pipeline import RankBubble
from opsd.policy.stragglers import StragglerScore
from opsd.protocol.policy_file import Command, Policy


class Window(Sequence[float]):
    """The last ``size`` values appended, oldest first."""

    __slots__ = ("_count", "_next", "_values")

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("a window holds at least one value")
        self._values = array("d", bytes(8 * size))
        self._next = 0  # where the next value goes
        self._count = 0

    def append(self, value: float) -> None:
        self.push(value)

    def push(self, value: float) -> float | None:
        """Append ``value``; the oldest value, when it falls out."""
        out = self._values[self._next] if self._count == len(self._values) else None
        self._values[self._next] = value
        self._next = (self._next + 1) % len(self._values)
        self._count = min(self._count + 1, len(self._values))
        return out

    def _ordered(self) -> array[float]:
        if self._count < len(self._values):
            return self._values[: self._count]
        return self._values[self._next :] + self._values[: self._next]

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[float]:
        return iter(self._ordered())

    @overload
    def __getitem__(self, index: int) -> float: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[float]: ...
    def __getitem__(self, index: int | slice) -> float | Sequence[float]:
        return self._ordered()[index]

    def __repr__(self) -> str:
        return f"Window({list(self)})"


class Ratios:
    """Each rank's last ``size`` ratios to its peers, and how many of them are at least ``slow``: one array for all
    ranks (a row per rank), so that adding a slot's 24,576 ratios is a few array stores each."""

    def __init__(self, size: int, slow: float) -> None:
        self.size, self.slow_ratio = size, slow
        self.rows: dict[int, int] = {}  # rank -> its row
        self.values = array("d")  # row * size + i: a ring per row
        self.next = array("q")  # per row: where its next value goes
        self.count = array("q")  # per row: values held
        self.slow = array("q")  # per row: values held that are slow

    def add(self, ranks: Sequence[int], ratios: Sequence[float | None]) -> None:
        """Add each rank's ratio to its peers in a slot (None: it has none)."""
        size, slow_ratio, rows, values = self.size, self.slow_ratio, self.rows, self.values
        nexts, counts, slow = self.next, self.count, self.slow
        for rank, ratio in zip(ranks, ratios, strict=True):
            if ratio is None:
                continue
            row = rows.get(rank)
            if row is None:
                row = rows[rank] = len(rows)
                values.extend(array("d", bytes(8 * size)))
                nexts.append(0)
                counts.append(0)
                slow.append(0)
            at = row * size + nexts[row]
            if counts[row] == size:
                slow[row] -= values[at] >= slow_ratio
            else:
                counts[row] += 1
            values[at] = ratio
            slow[row] += ratio >= slow_ratio
            nexts[row] = (nexts[row] + 1) % size

    def with_slow(self, at_least: float) -> list[int]:
        """The ranks with at least this many slow ratios."""
        slow = self.slow
        return [rank for rank, row in self.rows.items() if slow[row] >= at_least]

    def series(self, rank: int) -> list[float]:
        """A rank's ratios, oldest first."""
        row = self.rows[rank]
        start, n, size = row * self.size, self.count[row], self.size
        ring = self.values[start : start + size].tolist()
        return ring[:n] if n < size else ring[self.next[row] :] + ring[: self.next[row]]


class Samples:
    """Compute samples of ranks in slots that ended, grouped as they come: slot -> stage -> (ranks, their mean
    compute seconds per step). Numbers in lists: a slot's 24,576 samples are no objects to make, free, or follow for
    the garbage collector (whose young generation grows by every such object freed), and no pass to group them."""

    __slots__ = ("by_slot",)

    def __init__(self) -> None:
        self.by_slot: dict[int, dict[int, tuple[list[int], list[float]]]] = {}

    def add(self, slot: int, rank: int, stage: int, compute_s: float) -> None:
        stages = self.by_slot.get(slot)
        if stages is None:
            stages = self.by_slot[slot] = {}
        group = stages.get(stage)
        if group is None:
            group = stages[stage] = ([], [])
        group[0].append(rank)
        group[1].append(compute_s)


@dataclass(slots=True)
class RankLive:
    rank: int
    node: str
    step: int
    progress_s: float  # controller time when the step last advanced
    seen_s: float  # controller time when a heartbeat last carried it
    step_times_s: Window
    stage: int = 0  # pipeline stage (its ``pp`` coordinate)
    sample_slot: int = -1  # the newest slot with compute samples, not taken yet:
    sample_s: float = 0.0  # their compute seconds,
    sample_steps: int = 0  # over this many steps
    steps_total: int = -1  # the agent's running sums last seen (-1: none yet)
    compute_total_s: float = 0.0
    mfu_ratio: float = 0.0
    job_tokens_per_s: float = 0.0
    checkpoints: int = 0
    checkpoint_blocking_s: float = 0.0
    checkpoint_total_s: float = 0.0
    exit_code: int | None = None
    timeout: str = ""  # a collective timeout it reported and has not stepped past: what it waits on
    activity: str = ""  # what it said it does instead of stepping (a checkpoint it waits for, its end)
    activity_since_s: float = 0.0  # since when (controller time)
    resumed_from_step: int | None = None  # the checkpoint its launch resumed from, as its reports say
    bubble: RankBubble | None = None  # a pipeline stage's last bubble and schedule, as its reports say
    launch: int | None = None  # the launch of the run it belongs to, as its reports say (OPSD_LAUNCH)
    group: int | None = None  # a fault-tolerant run's: its replica group, as its reports say
    quorum_replicas: int = 0  # the replica groups in its last step's quorum
    quorum_wait_total_s: float = 0.0  # the seconds its training thread waited for a quorum, summed by its agent
    discarded_total: int = 0  # its group's steps it saw discarded (not committed), summed by its agent
    discarded_before: int = 0  # its discarded_total before it last changed,
    discarded_changed_s: float = -math.inf  # and when it changed (a failed group's incident counts from before it)


@dataclass(slots=True)
class NodeLive:
    """A node's signs of life: its heartbeats over HTTP and its liveness datagrams. Its intervals are those of the
    channel that carries its liveness: the datagrams' while they come, the heartbeats' otherwise (a heartbeat with
    its ranks, every few seconds between datagrams a second, is no interval of its liveness)."""

    node: str
    last_heartbeat_s: float  # its last sign of life, either kind
    intervals_s: Window
    events: dict[int, GpuEvent] = field(default_factory=dict)  # seq -> event not yet handled
    posted_s: float = -math.inf  # its last heartbeat over HTTP
    datagram_s: float = -math.inf  # its last liveness datagram taken
    liveness_seq: int = 0  # that datagram's seq: an older or equal one is a replay

    def posted(self, now_s: float) -> None:
        """A heartbeat over HTTP: an interval of its liveness when no datagram came since its last one."""
        if self.datagram_s < self.posted_s:
            self.intervals_s.append(now_s - self.posted_s)
        self.posted_s = now_s
        self.last_heartbeat_s = max(self.last_heartbeat_s, now_s)

    def alive(self, seq: int, now_s: float) -> None:
        """A liveness datagram (its ``seq`` checked newer)."""
        if self.datagram_s > -math.inf:
            self.intervals_s.append(now_s - self.datagram_s)
        self.datagram_s, self.liveness_seq = now_s, seq
        self.last_heartbeat_s = max(self.last_heartbeat_s, now_s)


class SlotClock:
    """Numbers the slots of time within which compute samples of peers are compared (``n = now // length`` while the
    length has not changed). A new length takes effect when the current slot ends, and the numbers go on increasing
    (a sample's slot is compared with the slot now: slots must never be numbered backwards)."""

    __slots__ = ("_origin", "_origin_s", "length_s")

    def __init__(self, length_s: float) -> None:
        if length_s <= 0:
            raise ValueError("a slot lasts > 0 s")
        self.length_s = length_s
        self._origin, self._origin_s = 0, 0.0  # slot ``_origin`` starts at ``_origin_s``

    def index(self, now_s: float) -> int:
        if now_s < self._origin_s:
            return self._origin - 1  # the slot before a new length began
        return self._origin + int((now_s - self._origin_s) // self.length_s)

    def resize(self, length_s: float, now_s: float) -> None:
        """Slots of ``length_s`` from the end of the current one."""
        if length_s <= 0:
            raise ValueError("a slot lasts > 0 s")
        if length_s == self.length_s:
            return
        current = self.index(now_s)
        if now_s >= self._origin_s:
            self._origin_s += (current - self._origin + 1) * self.length_s
        self._origin, self.length_s = current + 1, length_s


@dataclass
class RunLive:
    """The ranks of the current launch of a run, and what is kept over them as they change, so that a detection
    pass does not go over every rank: their nodes, newest step and progress, checkpoint sums, the ranks that exited
    or wait on a collective, and the compute samples of the slots that ended."""

    step_times_s: Window  # the run's newest step times, of any rank: its median step time
    ratios: Ratios  # each rank's last ratios to its peers
    ranks: dict[int, RankLive] = field(default_factory=dict)
    rank_nodes: dict[str, int] = field(default_factory=dict)  # node -> ranks of the run on it
    most_on_a_node: int = 0  # the most ranks heard from on one node
    world_size: int = 0  # the job's ranks, as its ranks say (0: not said)
    newest_step: int = -1
    latest_progress_s: float = -math.inf  # the newest progress (or start) of a rank
    exited: set[int] = field(default_factory=set)  # ranks whose process ended
    waiting: set[int] = field(default_factory=set)  # ranks that reported a collective timeout
    checkpoints: int = 0  # the ranks' checkpoints, summed
    checkpoint_blocking_s: float = 0.0  # and the seconds they blocked training
    checkpoint_total_s: float = 0.0  # and the seconds from their start to their commit (the write, async)
    checkpoints_done: int = 0  # checkpoints every rank of the launch has finished
    finished: Samples = field(default_factory=Samples)  # samples of ended slots, not taken yet
    scored_slot: int | None = None  # samples of the slots up to this one are taken

    def place(self, live: RankLive) -> None:
        """``live`` is now the record of its rank (a new rank, or one that moved to another node)."""
        old = self.ranks.get(live.rank)
        if old is not None:
            self.count_checkpoints(old, 0, 0.0)
            self.rank_nodes[old.node] -= 1
            if not self.rank_nodes[old.node]:
                del self.rank_nodes[old.node]
        self.ranks[live.rank] = live
        on_node = self.rank_nodes[live.node] = self.rank_nodes.get(live.node, 0) + 1
        self.most_on_a_node = max(self.most_on_a_node, on_node)
        self.latest_progress_s = max(self.latest_progress_s, live.progress_s)
        self.exited.discard(live.rank)
        self.waiting.discard(live.rank)

    @property
    def expected_nodes(self) -> int:
        """The nodes the job spans by its world size, at the most ranks heard from on one node (0: not said)."""
        if not self.world_size or not self.most_on_a_node:
            return 0
        return -(-self.world_size // self.most_on_a_node)

    def remove(self, rank: int) -> None:
        """``rank`` leaves the launch (its replica group was stopped): its sums and places go with it."""
        old = self.ranks.pop(rank, None)
        if old is None:
            return
        self.count_checkpoints(old, 0, 0.0)
        self.rank_nodes[old.node] -= 1
        if not self.rank_nodes[old.node]:
            del self.rank_nodes[old.node]
        self.exited.discard(rank)
        self.waiting.discard(rank)

    def count_checkpoints(self, live: RankLive, checkpoints: int, blocking_s: float, total_s: float = 0.0) -> None:
        self.checkpoints += checkpoints - live.checkpoints
        self.checkpoint_blocking_s += blocking_s - live.checkpoint_blocking_s
        self.checkpoint_total_s += total_s - live.checkpoint_total_s
        live.checkpoints, live.checkpoint_blocking_s, live.checkpoint_total_s = checkpoints, blocking_s, total_s

    def add_sample(self, live: RankLive, slot: int, compute_s: float, steps: int) -> None:
        """Add ``steps`` steps of ``compute_s`` seconds in all to the rank's sums of ``slot``."""
        if live.sample_steps and live.sample_slot != slot:  # a newer slot: the rank's sample of the last is final
            self.finished.add(live.sample_slot, live.rank, live.stage, live.sample_s / live.sample_steps)
            live.sample_steps = 0
        if live.sample_steps:
            live.sample_s += compute_s
            live.sample_steps += steps
        else:
            live.sample_slot, live.sample_s, live.sample_steps = slot, compute_s, steps

    def slot_ended(self, current_slot: int) -> bool:
        """Whether a slot ended since the samples were last taken."""
        return self.scored_slot is None or self.scored_slot < current_slot - 1

    def take_samples(self, ranks: list[RankLive], current_slot: int) -> None:
        """Move the samples of ``ranks`` in slots before ``current_slot`` to ``finished``."""
        for r in ranks:
            if r.sample_steps and r.sample_slot < current_slot:
                self.finished.add(r.sample_slot, r.rank, r.stage, r.sample_s / r.sample_steps)
                r.sample_steps = 0


class NodeComms:
    """One node's collective seconds of a run, a value per stack (the run's columns): as its agent last reported
    them, and what agents before a restart of it had reported."""

    __slots__ = ("earlier", "latest", "seconds")

    def __init__(self) -> None:
        self.latest = array("d")
        self.earlier = array("d")
        self.seconds = 0.0  # ``latest`` summed


class RunComms:
    """A run's collective seconds by (phase, dimension, op) stack, per node, as the agents report them in their
    heartbeats (cumulative since each agent started: the flame graph). A heartbeat replaces its node's values, in
    arrays of doubles (nothing for the garbage collector at thousands of nodes). An agent that restarted reports
    totals from zero again: when a node's seconds summed go down, its previous values are kept as ``earlier`` and
    added, so the run's totals do not go backwards (what the old agent counted after its last heartbeat is lost).
    """

    __slots__ = ("nodes", "stacks")

    def __init__(self) -> None:
        self.stacks: dict[tuple[str, str, str], int] = {}  # stack -> its column
        self.nodes: dict[str, NodeComms] = {}

    def update(self, node: str, rows: Sequence[Sequence[Any]]) -> None:
        """Replace ``node``'s values by the heartbeat's ``rows`` of this run: ``[run, phase, dimension, op,
        seconds, count, bytes]``."""
        columns = self.stacks
        values = array("d", bytes(8 * len(columns)))
        for row in rows:
            stack = (row[1], row[2], row[3])
            column = columns.get(stack)
            if column is None:
                column = columns[stack] = len(columns)
                values.append(0.0)
            values[column] += row[4]
        seconds = sum(values)
        held = self.nodes.get(node)
        if held is None:
            held = self.nodes[node] = NodeComms()
        elif seconds < held.seconds:  # a new agent, counting from zero
            earlier = held.earlier
            earlier.extend(array("d", bytes(8 * max(0, len(held.latest) - len(earlier)))))
            for i, value in enumerate(held.latest):
                earlier[i] += value
        held.latest, held.seconds = values, seconds

    def totals(self) -> dict[tuple[str, str, str], float]:
        """Seconds per stack, summed over the nodes (stacks with none left out)."""
        return comm_totals(*self.snapshot())

    def snapshot(self) -> tuple[dict[tuple[str, str, str], int], list[NodeComms]]:
        """What ``comm_totals`` sums, taken with the lock held (copies of two containers, in C) so that the sum can
        go without it: a heartbeat replaces a node's ``latest`` by a new array rather than writing into it."""
        return dict(self.stacks), list(self.nodes.values())


def comm_totals(stacks: dict[tuple[str, str, str], int], held: list[NodeComms]) -> dict[tuple[str, str, str], float]:
    """Seconds per stack of ``RunComms.snapshot``, summed over the nodes: column by column, in C (12,288 nodes x 18
    stacks: ~3 ms alone, but up to 60 ms beside the API's thread; a loop over every value took ~40 ms)."""
    rows = [h.latest for h in held] + [h.earlier for h in held if h.earlier]
    sums = [sum(column) for column in zip_longest(*rows, fillvalue=0.0)]
    return {stack: sums[column] for stack, column in stacks.items() if column < len(sums) and sums[column] > 0}


@dataclass
class RunMemory:
    """All the controller keeps of one run in memory, in one record, dropped a while after the run ended (a
    finished run is answered from the state store): its current launch's ranks, what it publishes to them, and
    what it measured. Rebuilt after a restart from the heartbeats, but for the cadence published, which the store
    keeps too (``RunRow.cadence``: taken up again by ``adopt_cadence``)."""

    live: RunLive | None = None  # the ranks of the current launch (None: none heard from since it began)
    cadence: Cadence | None = None  # the checkpoint cadence published to its ranks
    previous_cadence: Cadence | None = None  # in force before the current one's from_step
    stragglers: list[StragglerScore] = field(default_factory=list)  # the ranks flagged now
    agents_down: list[AgentDown] = field(default_factory=list)  # nodes whose agent is silent while their ranks train
    launched_s: float = 0.0  # when its current launch started
    launch: int | None = None  # the launch its ranks report (OPSD_LAUNCH), when the backend named it
    checkpoint_at: int | None = None  # a one-off checkpoint step asked for (a graceful restart)
    commands: list[Command] | None = None  # commands for its ranks (docs/protocol.md); None: never had one
    policy: Policy | None = None  # the policy its last heartbeat was told (None: none told yet)
    progressed_s: float | None = None  # when its newest step last advanced
    ended_step: int = -1  # the newest step of its previous launch (-1: unknown), its late reports counted too
    ended_launch: int | None = None  # the previous launch (OPSD_LAUNCH), when the backend named it
    ended_since_s: float = 0.0  # when the previous launch had started
    checkpointed_s: float | None = None  # when every rank had finished one more checkpoint
    comms: RunComms | None = None  # its collective seconds per node and stack (the flame graph)
    comms_before: dict[tuple[str, str, str], float] = field(default_factory=dict)  # its totals when its launch began
    recorded: tuple[float, int] | None = None  # when its launch was last recorded, and its newest step then
    group_launches: dict[int, int] = field(default_factory=dict)  # a fault-tolerant run's groups' launches
    groups_down: dict[int, GroupDown] = field(default_factory=dict)  # its groups stopped, until they are back
    # its replica groups being recovered alone -> their incident, told to the other groups' ranks until the group is
    # back in the quorum (None: it never had one; then {}, so that a policy that named one is replaced)
    failed_groups: dict[int, int] | None = None
    settled_s: float | None = None  # it finished with nothing left to close (forgotten some time after)

    def whole_launch(self, group_launches: Sequence[int]) -> None:
        """A launch of the whole job: every replica group (if any) is of it, at its launch in ``group_launches``."""
        self.group_launches = dict(enumerate(group_launches))
        self.groups_down.clear()
        self.groups_back()

    def group_failed(self, group: int, incident: int) -> None:
        """Replica group ``group`` is recovered alone from ``incident``: the others are told (``failed_groups``)."""
        if self.failed_groups is None:
            self.failed_groups = {}
        self.failed_groups[group] = incident

    def groups_back(self, groups: Sequence[int] | None = None) -> None:
        """``groups`` (None: every group) are back in the quorum, or the whole job relaunched: no longer said failed."""
        if self.failed_groups:
            for group in list(self.failed_groups) if groups is None else groups:
                self.failed_groups.pop(group, None)
