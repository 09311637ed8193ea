"""Failure detection: what the controller sees (heartbeats, step progress, GPU events, exits) -> failures.

Pure: views in, ``Failure`` list out; ``now_s`` is an argument. Timeouts come from observed behaviour with floors:
a node is lost when its heartbeat is late by ``heartbeat_factor`` x its median interval (at least
``heartbeat_floor_s``); a run hangs when no rank's step has advanced for ``hang_factor`` x the median step time
(at least ``hang_floor_s``). So a 40-minute step does not look like a hang, and a 1 s step is not left hanging for
half an hour. A hang is judged on what the heartbeats that carry the ranks' steps saw: a liveness datagram or a
heartbeat without ranks (sent while the agent's last one with them failed and backs off) says the agent is alive,
not that its ranks stopped.

A silent agent is not a lost node by itself: the agent is opsd's own component, and it goes quiet whenever it is
rolled (a new image or setting), restarted, killed for its memory, or refused while its token or certificate
rotates, while the node's ranks train on. Its silence is a failure (``HEARTBEAT_LOSS``) only when a second witness
agrees: in synchronous training the peers of its ranks (the ranks of the same replica group on nodes that are heard
from) cannot complete a step without them, so peers still stepping after the silence began prove its ranks alive
(``AGENT_DOWN``: an operations event, no recovery); peers that stopped confirm it. A node with no such peer is judged
by the backend's view of it when the controller has one (``node_ready``: Kubernetes' Node condition and the pods',
the local backend's rank processes), and is declared lost as before when there is neither. A peer's step proves
life when it is seen later than ``witness_grace_s`` after the node's last sign of life (its next beat, the one step
its peers may finish without it, the interval at which their steps are reported, a margin); the verdict is given
once such a step would have been seen (one report interval later), so a dead node with live-looking peers is
declared after max(heartbeat timeout, grace + report interval): with ranks reported every second and steps under
6 s, within the 10 s floor as before; at 12,288 nodes, whose ranks are reported every 9 s, about 20 s plus a step.

The first failure is the cause, the others its consequences: a swap first, then a rank killed by a signal (a rank
whose peer died exits with an error of its own, often seen in the same pass), then by node and rank.

What each failure asks for (``Failure.swap``): a node that stopped sending heartbeats or reported a fatal XID is
swapped for a spare; a rank that exited, a hang, an application XID or a collective timeout restarts the ranks on
the same nodes. Ranks that report a collective timeout are waiting for a peer: the failure names a rank that does
not wait (the one furthest behind) as the suspect. A controller that takes up a run after its predecessor stopped
records a ``controller_restart`` (the ranks it could no longer supervise are killed and relaunched).

A pass costs what it must at scale (24,576 ranks every half second): views are anything with the attributes of
``NodeView`` and ``RankView`` (read only; the controller passes its live records as they are, not copies), and the
medians of the observed intervals and step times are computed only for what has been quiet for longer than its
floor (a timeout is never shorter than its floor).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from opsd.protocol.ft import EXIT_NO_QUORUM
from opsd.protocol.states import FAILURE_KINDS, IncidentKind
from opsd.protocol.xid_table import XidAction

#: a failure's kind is an incident's (one definition: ``opsd.protocol.states.IncidentKind``), any but the warnings
#: (``WARNING_KINDS``); ``CONTROLLER_RESTART`` and ``MANUAL_RESTART`` are not detected here (a controller that takes
#: up a run, ``opsd restart``)
FailureKind = IncidentKind


SWAP_KINDS = frozenset({FailureKind.HEARTBEAT_LOSS, FailureKind.FATAL_XID})


@dataclass(frozen=True)
class DetectionConfig:
    heartbeat_factor: float = 5.0
    heartbeat_floor_s: float = 10.0
    hang_factor: float = 3.0
    hang_floor_s: float = 60.0
    witness_margin_s: float = 1.0  # added to the time a peer's step may take to be seen (a pass, jitter)
    busy_limit_s: float = 1800.0  # the longest a rank may say it waits for a checkpoint or ends, unjudged
    # more time a replica group is given before it is judged hung while another group of its run is recovered: it may
    # be waiting on the failed group in a collective until its timeout (torchft's is 60 s), unless its ranks heard
    # that the group failed (docs/ft.md)
    peer_wait_s: float = 120.0

    def __post_init__(self) -> None:
        if self.heartbeat_factor < 1 or self.hang_factor < 1:
            raise ValueError("detection.heartbeat_factor and detection.hang_factor must be >= 1")
        if self.heartbeat_floor_s <= 0 or self.hang_floor_s <= 0:
            raise ValueError("detection.heartbeat_floor_s and detection.hang_floor_s must be > 0")
        if self.witness_margin_s < 0:
            raise ValueError("detection.witness_margin_s must be >= 0")
        if self.busy_limit_s <= 0:
            raise ValueError("detection.busy_limit_s must be > 0")
        if self.peer_wait_s < 0:
            raise ValueError("detection.peer_wait_s must be >= 0")


@dataclass(frozen=True)
class NodeView:
    node: str
    last_heartbeat_s: float
    intervals_s: tuple[float, ...] = ()  # recent intervals between its heartbeats


@dataclass(frozen=True)
class RankView:
    rank: int
    node: str
    step: int  # the last step reported
    progress_s: float  # when its step last advanced (or when it started)
    exit_code: int | None = None  # set when its process has exited
    seen_s: float = math.inf  # when a heartbeat last carried it (inf: now, its step is as of now)
    activity: str = ""  # what it said it does instead of stepping (``opsd.protocol.wire.ActivityReport``)
    activity_since_s: float = 0.0  # since when


class NodeLike(Protocol):
    """What detection reads of a node: ``NodeView``'s attributes."""

    @property
    def node(self) -> str: ...
    @property
    def last_heartbeat_s(self) -> float: ...
    @property
    def intervals_s(self) -> Sequence[float]: ...


class RankLike(Protocol):
    """What detection reads of a rank: ``RankView``'s attributes."""

    @property
    def rank(self) -> int: ...
    @property
    def node(self) -> str: ...
    @property
    def step(self) -> int: ...
    @property
    def progress_s(self) -> float: ...
    @property
    def exit_code(self) -> int | None: ...
    @property
    def seen_s(self) -> float: ...
    @property
    def activity(self) -> str: ...
    @property
    def activity_since_s(self) -> float: ...


@dataclass(frozen=True)
class GpuEvent:
    node: str
    gpu: int
    xid: int
    action: XidAction  # the agent's decision: a swap or a restart (an event it only counted is not one)
    reason: str = ""
    time_s: float | None = None  # when the agent saw it (Unix time, the node's clock)
    trace_id: str = ""  # the agent's span of it (W3C ids in hex; "": the agent exports no spans)
    span_id: str = ""


@dataclass(frozen=True)
class CollectiveTimeout:
    rank: int
    node: str
    detail: str


@dataclass(frozen=True)
class Failure:
    kind: FailureKind
    node: str
    rank: int | None
    detail: str
    signal: bool = False  # a rank killed by a signal (its exit code negative)

    def __post_init__(self) -> None:
        if self.kind not in FAILURE_KINDS:
            raise ValueError(f"failure: {self.kind!r} is a warning, not a failure")

    @property
    def swap(self) -> bool:
        return self.kind in SWAP_KINDS


@dataclass(frozen=True)
class AgentDown:
    """A node whose agent is silent past its heartbeat timeout while its ranks are proven alive: an operations event
    (the agent rolled, restarted or was refused), recorded and alerted on, never recovered from."""

    node: str
    detail: str


@dataclass(frozen=True)
class Findings:
    failures: list[Failure]  # the ones that need a swap first
    agents_down: list[AgentDown]


def heartbeat_timeout_s(intervals_s: Sequence[float], config: DetectionConfig) -> float:
    if not intervals_s:
        return config.heartbeat_floor_s
    return max(config.heartbeat_floor_s, config.heartbeat_factor * statistics.median(intervals_s))


def hang_timeout_s(step_times_s: Sequence[float], config: DetectionConfig) -> float:
    if not step_times_s:
        return config.hang_floor_s
    return max(config.hang_floor_s, config.hang_factor * statistics.median(step_times_s))


def witness_grace_s(
    intervals_s: Sequence[float], step_times_s: Sequence[float], report_interval_s: float, config: DetectionConfig
) -> float:
    """How long after a node's last sign of life its peers may still report a step if the node died then: its
    agent's next beat (the median interval), the one step they may finish without it (the median step time), the
    interval at which their agents send their steps, and a margin. A peer's step reported later proves the node's
    ranks alive."""
    beat_s = statistics.median(intervals_s) if intervals_s else 0.0
    step_s = statistics.median(step_times_s) if step_times_s else 0.0
    return beat_s + step_s + report_interval_s + config.witness_margin_s


def detect_failures(**kwargs: object) -> list[Failure]:
    """``detect(...)``'s failures."""
    return detect(**kwargs).failures  # type: ignore[arg-type]


def detect(
    *,
    now_s: float,
    nodes: Iterable[NodeLike],
    ranks: Iterable[RankLike],
    events: Iterable[GpuEvent] = (),
    timeouts: Iterable[CollectiveTimeout] = (),
    step_times_s: Sequence[float] = (),
    config: DetectionConfig,
    rank_groups: Mapping[int, int] | None = None,
    report_interval_s: float = 1.0,
    node_ready: Mapping[str, bool] | None = None,
    recovering: Collection[int] = (),
) -> Findings:
    """Every failure visible now, the ones that need a swap first, and the nodes whose agent is down while their
    ranks train. ``rank_groups``: a fault-tolerant run's ranks' replica groups (rank -> group): a group that made no
    progress while others did hangs on its own, and a rank that exited with ``EXIT_NO_QUORUM`` found no quorum
    (``NO_QUORUM``); a silent node's peers are the ranks of its ranks' groups. ``report_interval_s``: how often the
    agents send their ranks' steps. ``node_ready``: the backend's view of a node (True: up, its ranks' processes
    running; False: down), where it has one. ``recovering``: the replica groups being recovered alone; while there
    is one, the others are judged hung ``peer_wait_s`` later (they may wait on it until their collective's timeout)."""
    out: list[Failure] = []
    down: list[AgentDown] = []
    rank_list = list(ranks)
    # a rank's step is known as of the last heartbeat that carried it: one no heartbeat carried within the floor and
    # the interval its agent sends steps at is neither judged hung nor a witness (its node's liveness datagrams, or
    # heartbeats without ranks while the agent's last one with them failed and backs off, say the agent is alive)
    unseen_s = now_s - config.heartbeat_floor_s - report_interval_s
    late = []
    node_list = list(nodes)
    for n in node_list:
        silent = now_s - n.last_heartbeat_s
        if silent <= config.heartbeat_floor_s:
            continue  # never late within the floor, whatever its intervals
        limit = heartbeat_timeout_s(n.intervals_s, config)
        if silent > limit:
            late.append((n, f"no heartbeat for {silent:.1f} s > {limit:.1f} s"))
    if late:
        # one pass over the ranks, whatever the number of silent nodes (an agent roll silences many at scale):
        # each silent node's own running ranks, and each group's newest step seen on a node heard from
        silent_nodes = {n.node for n, _ in late}
        own: dict[str, list[RankLike]] = {}
        latest: dict[int | None, float] = {}
        busy: set[int | None] = set()  # groups a peer of which says it does not step (a save): no witness either way
        for r in rank_list:
            if r.exit_code is not None:
                continue
            group = rank_groups.get(r.rank) if rank_groups is not None else None
            if r.node in silent_nodes:
                own.setdefault(r.node, []).append(r)
            elif _busy(r, now_s, config):
                busy.add(group)
            elif r.seen_s >= unseen_s and r.progress_s > latest.get(group, -math.inf):
                latest[group] = r.progress_s
        for n, detail in late:
            grace_s = witness_grace_s(n.intervals_s, step_times_s, report_interval_s, config)
            mine = own.get(n.node, [])
            of_mine = {rank_groups.get(r.rank) if rank_groups is not None else None for r in mine}
            seen = [latest[g] for g in of_mine if g in latest and g not in busy]
            peers_s = min(seen) if mine and len(seen) == len(of_mine) else None  # every group's peers must step
            ready = node_ready.get(n.node) if node_ready is not None else None
            verdict = _judge_silence(n, now_s, bool(mine), peers_s, ready, grace_s, report_interval_s)
            if verdict is None:
                continue  # a peer's step may still be on its way
            lost, why = verdict
            if lost:
                out.append(Failure(FailureKind.HEARTBEAT_LOSS, n.node, None, f"{detail}; {why}"))
            else:
                down.append(AgentDown(n.node, f"{detail}; {why}"))
    for e in events:
        kind = FailureKind.FATAL_XID if e.action is XidAction.CORDON_AND_SWAP else FailureKind.APPLICATION_XID
        out.append(Failure(kind, e.node, None, f"XID {e.xid} on GPU {e.gpu}: {e.reason or e.action}"))
    for r in rank_list:
        if r.exit_code is not None and r.exit_code != 0:
            no_quorum = rank_groups is not None and r.exit_code == EXIT_NO_QUORUM
            kind = FailureKind.NO_QUORUM if no_quorum else FailureKind.PROCESS_EXIT
            signal = r.exit_code < 0
            out.append(Failure(kind, r.node, r.rank, f"rank {r.rank} exited with {r.exit_code}", signal=signal))
    running = [r for r in rank_list if r.exit_code is None]
    waiting = list(timeouts)
    if waiting:
        # the ranks that wait are victims: the suspect is a rank that does not wait (stopped, dead or slow), the
        # furthest behind; when every rank waits, the first that reported
        waiters = {t.rank for t in waiting}
        others = [r for r in running if r.rank not in waiters]
        if others:
            suspect = min(others, key=lambda r: (r.step, r.progress_s, r.rank))
            node, rank, named = suspect.node, suspect.rank, f"suspect: rank {suspect.rank}, not waiting"
        else:
            node, rank, named = waiting[0].node, waiting[0].rank, "every rank waits"
        detail = "; ".join(t.detail for t in waiting[:3]) + (f" (+{len(waiting) - 3} more)" if len(waiting) > 3 else "")
        out.append(Failure(FailureKind.COLLECTIVE_TIMEOUT, node, rank, f"{detail}; {named}"))
    # a rank's progress is seen through its node's agent: the ranks of a node silent past the floor say nothing of
    # it, nor does a rank not seen lately (above), and a group with no other rank is not judged hung (its agents are
    # silent, not necessarily its ranks)
    unheard = {n.node for n in node_list if now_s - n.last_heartbeat_s > config.heartbeat_floor_s}
    groups: dict[int | None, list[RankLike]] = {}
    for r in running:  # a fault-tolerant run's groups step on their own: each may hang alone
        if r.node not in unheard and r.seen_s >= unseen_s:
            groups.setdefault(rank_groups.get(r.rank) if rank_groups is not None else None, []).append(r)
    for group, members in sorted(groups.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
        wait_s = config.peer_wait_s if group is not None and set(recovering) - {group} else 0.0
        hang = _hang(
            now_s, members, step_times_s, config, "" if group is None else f" in replica group {group}", wait_s
        )
        if hang is not None:
            out.append(hang)
    # a rank killed by a signal (the OOM killer, a crash, SIGKILL) before one that exited with an error: the peers of a
    # rank that died fail their next collective and exit with an error, often within the same pass
    failures = sorted(out, key=lambda f: (not f.swap, not f.signal, f.node, -1 if f.rank is None else f.rank))
    return Findings(failures, down)


def _judge_silence(
    n: NodeLike,
    now_s: float,
    has_ranks: bool,
    peers_s: float | None,
    ready: bool | None,
    grace_s: float,
    report_interval_s: float,
) -> tuple[bool, str] | None:
    """Whether a node silent past its timeout is lost (True) or only its agent is down (False), and what says so;
    None while a peer's step proving it alive may still be on its way. ``peers_s``: when the peers of its ranks (the
    running ranks of their groups on nodes heard from) last stepped, the least recent group's (None: a group of its
    ranks has no such peer); ``ready``: the backend's view of it (None: none)."""
    proof_s = n.last_heartbeat_s + grace_s  # a peer's step seen after this proves the node's ranks alive
    if peers_s is not None:
        if peers_s > proof_s:
            return False, f"its ranks' peers stepped {peers_s - n.last_heartbeat_s:.1f} s after its last beat"
        if now_s <= proof_s + report_interval_s:
            return None
        return True, f"its ranks' peers stopped too (no step seen {grace_s:.1f} s after its last beat)"
    if ready is not None:
        return (not ready), f"the backend says the node is {'up, its ranks running' if ready else 'down'}"
    return True, "no peer or backend to witness its ranks" if has_ranks else "it runs no rank of the run"


def _hang(
    now_s: float,
    running: list[RankLike],
    step_times_s: Sequence[float],
    config: DetectionConfig,
    where: str,
    wait_s: float = 0.0,
) -> Failure | None:
    """A hang of ``running`` ranks: none of them stepped for longer than the hang timeout (and ``wait_s``: a peer
    group is being recovered), as far as the heartbeats that carried them saw (from the newest step to the oldest of
    their last heartbeats: none stepped in between)."""
    latest = max(r.progress_s for r in running)
    stalled = min(now_s, min(r.seen_s for r in running)) - latest
    # the median step time only when quiet for longer than the floor (the limit is never below it)
    limit = hang_timeout_s(step_times_s, config) if stalled > config.hang_floor_s else config.hang_floor_s
    limit += wait_s
    if stalled <= limit or any(_busy(r, now_s, config) for r in running):
        return None  # a rank that says it waits for a checkpoint or ends holds its peers in their next collective
    # the culprit is most likely the rank furthest behind (the others wait for it in a collective)
    behind = min(running, key=lambda r: (r.step, r.progress_s, r.rank))
    detail = f"no step progress{where} for {stalled:.1f} s > {limit:.1f} s; furthest behind: rank {behind.rank}"
    if wait_s:
        detail += f" (the limit {wait_s:.0f} s longer: another replica group is being recovered)"
    said = next((r for r in running if r.activity), None)
    if said is not None:
        age_s = now_s - said.activity_since_s
        detail += f"; rank {said.rank} said {said.activity!r} {age_s:.0f} s ago (> {config.busy_limit_s:.0f} s)"
    return Failure(FailureKind.HANG, behind.node, behind.rank, detail)


def _busy(r: RankLike, now_s: float, config: DetectionConfig) -> bool:
    """Whether ``r`` said it does not step for a reason it knows (a checkpoint it waits for, its end), lately."""
    return bool(r.activity) and now_s - r.activity_since_s <= config.busy_limit_s
