"""The controller: takes the agents' heartbeats, detects failures and stragglers, keeps incidents, publishes the
checkpoint cadence, and drives a backend through recoveries.

Durable state is in the ``Store``; what the heartbeats say (liveness, progress, compute samples, checkpoint
costs) is kept in memory and rebuilt within seconds after a restart. Decisions are the pure functions of
``opsd.policy``; this module gathers their inputs, applies their outputs, and logs one line per decision.
Time comes in as ``now_s`` (the controller's wall clock), so tests drive it.
"""

from __future__ import annotations

import logging
import statistics
import threading
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from opsd.policy.cadence import Cadence, CadenceConfig, plan_cadence
from opsd.policy.detection import (
    CollectiveTimeout,
    DetectionConfig,
    Failure,
    FailureKind,
    GpuEvent,
    NodeView,
    RankView,
    detect_failures,
)
from opsd.policy.goodput import Goodput, Interruption, account
from opsd.policy.spares import Spare, select_spare
from opsd.policy.stragglers import ComputeSample, StragglerConfig, StragglerScore, score_stragglers
from opsd.store import Store

log = logging.getLogger(__name__)

ACTIONABLE_EVENTS = ("cordon_and_swap", "restart_job")


@dataclass(frozen=True)
class ControllerConfig:
    detection: DetectionConfig = field(default_factory=DetectionConfig)
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    cadence: CadenceConfig = field(default_factory=CadenceConfig)
    sample_slot_s: float = 2.0  # compute samples of ranks are compared within slots of this length
    history: int = 64  # heartbeat intervals and step times kept per node / rank

    def __post_init__(self) -> None:
        if self.sample_slot_s <= 0:
            raise ValueError("controller.sample_slot_s must be > 0")
        if self.history < 2:
            raise ValueError("controller.history must be >= 2")


class Backend(Protocol):
    """What the controller asks of the machines (local processes, or Kubernetes). Every call is idempotent for a
    given ``request_id``: the controller may repeat one after a restart."""

    def recover(self, controller: Controller, run: str, incident_id: int, failure: Failure, now_s: float) -> None:
        """Carry out (or go on with) the recovery of ``run`` from ``failure``, without blocking the caller."""
        ...

    def resumed_from_step(self, run: str) -> int | None:
        """The checkpoint step the current launch resumed from, when the backend knows it."""
        ...


@dataclass
class RankLive:
    node: str
    step: int
    progress_s: float  # controller time when the step last advanced
    coords: dict[str, int]
    step_times_s: deque[float]
    compute: deque[tuple[int, float, int]]  # (slot, compute seconds, steps) summed per slot
    counters: tuple[int, float] | None = None  # the agent's (steps_total, compute_total_s) last seen
    mfu_ratio: float = 0.0
    job_tokens_per_s: float = 0.0
    checkpoints: int = 0
    checkpoint_blocking_s: float = 0.0
    exit_code: int | None = None
    timeout: str = ""  # a collective timeout it reported and has not stepped past: what it waits on


@dataclass
class NodeLive:
    last_s: float
    intervals_s: deque[float]
    events: dict[int, GpuEvent] = field(default_factory=dict)  # seq -> event not yet handled


class Controller:
    def __init__(self, store: Store, config: ControllerConfig | None = None, backend: Backend | None = None) -> None:
        self.store = store
        self.config = config or ControllerConfig()
        self.backend = backend
        self.lock = threading.RLock()
        self.nodes: dict[str, NodeLive] = {}
        self.ranks: dict[str, dict[int, RankLive]] = defaultdict(dict)  # run -> rank -> live
        self.cadences: dict[str, Cadence] = {}
        self.previous_cadences: dict[str, Cadence] = {}  # in force before the current one's from_step
        self.stragglers: dict[str, list[StragglerScore]] = {}
        self.heartbeats_total = 0
        self.launched_s: dict[str, float] = {}  # run -> when its current launch started
        self.known_runs: set[str] = set()  # runs the store has (recorded once, not at every heartbeat)

    # -- heartbeats --------------------------------------------------------------------------------------------
    def heartbeat(self, body: dict[str, Any], now_s: float) -> dict[str, Any]:
        """Take one validated heartbeat (``docs/protocol.md``); the reply: events acknowledged, and the policy."""
        node = str(body["node"])
        with self.lock:
            self.heartbeats_total += 1
            live = self.nodes.get(node)
            if live is None:
                live = self.nodes[node] = NodeLive(now_s, deque(maxlen=self.config.history))
            else:
                live.intervals_s.append(now_s - live.last_s)
                live.last_s = now_s
            known = self.store.node(node)
            acked = int(known["events_acked"]) if known else 0
            for e in body.get("events", []):
                if int(e["seq"]) > acked and e["action"] in ACTIONABLE_EVENTS:
                    live.events.setdefault(int(e["seq"]), GpuEvent(node, e["gpu"], e["xid"], e["action"], e["reason"]))
            runs = set()
            for r in body.get("ranks", []):
                runs.add(r["run"])
                self._rank(r, node, now_s)
            for t in body.get("timeouts", []):
                self._timeout(t, node)
            for run in sorted(runs - self.known_runs):
                if self.store.create_run(run, {"observed": True}, now_s):
                    log.info("run %s first seen in a heartbeat from node %s", run, node)
                self.known_runs.add(run)
            for run in sorted(runs):
                if known is None or known["run"] is None:
                    self.store.upsert_node(node, now_s, run=run, role="active")
                    known = self.store.node(node)
            # events that need no action are acknowledged at once; the others once their incident is recorded
            newest = max((int(e["seq"]) for e in body.get("events", [])), default=acked)
            ack = min(live.events) - 1 if live.events else max(acked, newest)
            if ack > acked:
                self.store.upsert_node(node, now_s, events_acked=ack)
            reply: dict[str, Any] = {"ack_events_up_to": ack}
            run_of_node = known["run"] if known else None
            if run_of_node in self.cadences:
                c = self.cadences[run_of_node]
                checkpoint: dict[str, Any] = {"every_steps": c.every_steps, "from_step": c.from_step}
                if run_of_node in self.previous_cadences:
                    p = self.previous_cadences[run_of_node]
                    checkpoint["previous"] = {"every_steps": p.every_steps, "from_step": p.from_step}
                reply["policy"] = {"checkpoint": checkpoint}
            return reply

    def _rank(self, r: dict[str, Any], node: str, now_s: float) -> None:
        run, rank = str(r["run"]), int(r["rank"])
        if float(r.get("last_report_unix_s", now_s)) < self.launched_s.get(run, 0.0):
            return  # the agent still remembers a rank of an earlier launch
        live = self.ranks[run].get(rank)
        if live is None or live.node != node:
            live = RankLive(
                node, -1, now_s, {}, deque(maxlen=self.config.history), deque(maxlen=self.config.stragglers.window * 2)
            )
            self.ranks[run][rank] = live
        step = int(r["step"])
        slot = int(now_s // self.config.sample_slot_s)
        steps_total, compute_total_s = int(r.get("steps_total", 0)), float(r.get("compute_total_s", 0.0))
        if steps_total:  # the agent's running sums: the mean compute of the steps since the last heartbeat
            before = live.counters
            live.counters = (steps_total, compute_total_s)
            if before is not None and steps_total > before[0] and compute_total_s >= before[1]:
                _add_sample(live.compute, slot, compute_total_s - before[1], steps_total - before[0])
        if step != live.step:
            if step > live.step >= 0:
                live.step_times_s.append(float(r["step_s"]))
                if not steps_total:  # an agent without running sums: the last step's compute
                    _add_sample(live.compute, slot, float(r.get("compute_s", r["step_s"])), 1)
            live.step = step
            live.progress_s = now_s
            live.timeout = ""  # it stepped on: whatever it waited on is over
        live.coords = dict(r.get("coords", {}))
        live.mfu_ratio = float(r.get("mfu_ratio", 0.0))
        live.job_tokens_per_s = float(r.get("job_tokens_per_s", 0.0))
        live.checkpoints = int(r.get("checkpoints", 0))
        live.checkpoint_blocking_s = float(r.get("checkpoint_blocking_s", 0.0))

    def _timeout(self, t: dict[str, Any], node: str) -> None:
        run, rank = str(t["run"]), int(t["rank"])
        live = self.ranks.get(run, {}).get(rank)
        if live is None or live.node != node or float(t["time_unix_s"]) < self.launched_s.get(run, 0.0):
            return  # a rank of an earlier launch, or one not heard from yet
        if int(t["step"]) >= live.step:  # still waiting in the step after its last report
            live.timeout = f"rank {rank} waited {float(t['waited_s']):.0f} s in {t['op']} on {t['dim']}"

    def rank_exited(self, run: str, rank: int, node: str, exit_code: int, now_s: float) -> None:
        """The backend saw a rank process end."""
        with self.lock:
            live = self.ranks[run].get(rank)
            if live is None:
                live = self.ranks[run][rank] = RankLive(node, -1, now_s, {}, deque(maxlen=2), deque(maxlen=2))
            live.exit_code = exit_code

    def forget_ranks(self, run: str, now_s: float) -> None:
        """A relaunch: the ranks of ``run`` start over (their progress and samples belong to the old launch); what
        agents report from before ``now_s`` is ignored."""
        with self.lock:
            self.ranks.pop(run, None)
            self.stragglers.pop(run, None)
            self.launched_s[run] = now_s

    # -- decisions ---------------------------------------------------------------------------------------------
    def tick(self, now_s: float) -> list[Failure]:
        """Detect failures of running runs and start their recovery; score stragglers; plan cadences."""
        found: list[Failure] = []
        with self.lock:
            for run in self.store.runs():
                if run["state"] == "waiting_for_spare":
                    self._retry_waiting(run, now_s)
                if run["state"] != "running":
                    continue
                self._progress(run, now_s)
                failures = self._detect(run["id"], now_s)
                if failures:
                    found.extend(failures)
                    self._open(run, failures, now_s)
                    continue
                self._score(run["id"], now_s)
                self._plan(run, now_s)
        return found

    def _views(
        self, run: str
    ) -> tuple[list[NodeView], list[RankView], list[GpuEvent], list[CollectiveTimeout], list[float]]:
        ranks = self.ranks.get(run, {})
        node_names = {n["name"] for n in self.store.nodes(run) if n["role"] == "active"} | {
            r.node for r in ranks.values()
        }
        nodes = [
            NodeView(n, self.nodes[n].last_s, tuple(self.nodes[n].intervals_s)) for n in node_names if n in self.nodes
        ]
        events = [e for n in node_names if n in self.nodes for e in self.nodes[n].events.values()]
        views = [RankView(rank, r.node, r.step, r.progress_s, r.exit_code) for rank, r in sorted(ranks.items())]
        timeouts = [CollectiveTimeout(rank, r.node, r.timeout) for rank, r in sorted(ranks.items()) if r.timeout]
        step_times = [t for r in ranks.values() for t in r.step_times_s]
        return nodes, views, events, timeouts, step_times

    def _detect(self, run: str, now_s: float) -> list[Failure]:
        nodes, ranks, events, timeouts, step_times = self._views(run)
        if not ranks and not events:
            return []
        return detect_failures(
            now_s=now_s,
            nodes=nodes,
            ranks=ranks,
            events=events,
            timeouts=timeouts,
            step_times_s=step_times,
            config=self.config.detection,
        )

    def _open(self, run: dict[str, Any], failures: list[Failure], now_s: float) -> None:
        """One incident per launch: the first failure (a swap first) is the cause; the rest are its consequences."""
        cause = failures[0]
        generation = int(run["generation"])
        key = f"{run['id']}/gen{generation}"
        failed_s = self._failed_at(run["id"], cause, now_s)
        incident, new = self.store.open_incident(
            key=key,
            run=run["id"],
            kind=cause.kind.value,
            node=cause.node,
            rank=cause.rank,
            detail=cause.detail,
            failed_s=failed_s,
            detected_s=now_s,
        )
        if new:
            others = "; ".join(f"{f.kind.value} on {f.node}" for f in failures[1:]) or "none"
            log.warning(
                "run %s: incident %d: %s on %s (rank %s): %s; also seen: %s",
                run["id"],
                incident,
                cause.kind.value,
                cause.node,
                cause.rank,
                cause.detail,
                others,
            )
        self._handled_events(cause, now_s)
        if self.backend is not None:
            self.store.update_run(run["id"], now_s, state="recovering")
            self.backend.recover(self, run["id"], incident, cause, now_s)

    def _progress(self, run: dict[str, Any], now_s: float) -> None:
        """Keep the run's newest step, and close the incidents a relaunch has recovered from: the first progress of
        the new launch is the first productive step (lost steps: from the checkpoint resumed from to the newest
        step before the failure)."""
        ranks = [r for r in self.ranks.get(run["id"], {}).values() if r.step >= 0]
        if not ranks:
            return
        for incident in self.store.incidents(run["id"], state="open"):
            if _generation_of(incident["key"]) >= int(run["generation"]):
                continue
            first = min(r.step for r in ranks)
            resumed_from = self.backend.resumed_from_step(run["id"]) if self.backend is not None else None
            if resumed_from is None:
                resumed_from = max(0, first - 1)
            lost = max(0, int(run["last_step"]) - resumed_from)
            resumed_s = min(r.progress_s for r in ranks)
            self.store.update_incident(
                incident["id"], state="recovered", resumed_s=resumed_s, resumed_from_step=resumed_from, lost_steps=lost
            )
            log.info(
                "run %s: incident %d recovered: resumed from step %d, %d steps lost, %.1f s after detection",
                run["id"],
                incident["id"],
                resumed_from,
                lost,
                resumed_s - incident["detected_s"],
            )
        newest = max(r.step for r in ranks)
        if newest > int(run["last_step"]):
            self.store.update_run(run["id"], now_s, last_step=newest)

    def _failed_at(self, run: str, cause: Failure, now_s: float) -> float:
        """When the failure happened, as well as the controller can tell: the last sign of life."""
        if cause.kind is FailureKind.HEARTBEAT_LOSS and cause.node in self.nodes:
            return self.nodes[cause.node].last_s
        if cause.kind is FailureKind.HANG:
            return max((r.progress_s for r in self.ranks.get(run, {}).values()), default=now_s)
        return now_s

    def _handled_events(self, cause: Failure, now_s: float) -> None:
        if cause.kind not in (FailureKind.FATAL_XID, FailureKind.APPLICATION_XID):
            return
        live = self.nodes.get(cause.node)
        if live is None or not live.events:
            return
        newest = max(live.events)
        live.events.clear()
        self.store.upsert_node(cause.node, now_s, events_acked=newest)

    def _score(self, run: str, now_s: float) -> None:
        samples = [
            ComputeSample(rank, r.node, int(r.coords.get("pp", 0)), slot, seconds / steps)
            for rank, r in self.ranks.get(run, {}).items()
            for slot, seconds, steps in r.compute
        ]
        scores = score_stragglers(samples, self.config.stragglers)
        before = {s.rank for s in self.stragglers.get(run, []) if s.flagged}
        for s in scores:
            if s.flagged and s.rank not in before:
                log.warning(
                    "run %s: straggler rank %d on %s (stage %d): %.2fx its peers over %d samples",
                    run,
                    s.rank,
                    s.node,
                    s.stage,
                    s.slowdown_ratio,
                    s.samples,
                )
                generation = int((self.store.run(run) or {}).get("generation", 0))
                incident, _ = self.store.open_incident(
                    key=f"{run}/gen{generation}/straggler/{s.rank}",
                    run=run,
                    kind="straggler",
                    node=s.node,
                    rank=s.rank,
                    detail=f"compute {s.slowdown_ratio:.2f}x the median of its peers over {s.samples} samples",
                    failed_s=now_s,
                    detected_s=now_s,
                )
                self.store.update_incident(incident, state="warned")  # a warning: nothing to recover
        self.stragglers[run] = scores

    def _plan(self, run: dict[str, Any], now_s: float) -> None:
        ranks = self.ranks.get(run["id"], {})
        step_times = [t for r in ranks.values() for t in r.step_times_s]
        saves = sum(r.checkpoints for r in ranks.values())
        if not step_times or not saves:
            return  # nothing measured yet: the ranks keep their local cadence
        cost_s = sum(r.checkpoint_blocking_s for r in ranks.values()) / saves
        failures = [i for i in self.store.incidents(run["id"]) if i["kind"] != "straggler"]
        nodes = max(1, len({r.node for r in ranks.values()}))
        node_hours = nodes * max(0.0, now_s - float(run["created_s"])) / 3600.0
        previous = self.cadences.get(run["id"])
        cadence = plan_cadence(
            checkpoint_cost_s=cost_s,
            step_time_s=statistics.median(step_times),
            current_step=max(r.step for r in ranks.values()),
            failures=len(failures),
            node_hours=node_hours,
            nodes=nodes,
            config=self.config.cadence,
            previous=previous,
        )
        if cadence is not previous:
            log.info(
                "run %s: checkpoint every %d steps from step %d: %s",
                run["id"],
                cadence.every_steps,
                cadence.from_step,
                cadence.reason,
            )
            self.cadences[run["id"]] = cadence
            if previous is not None:
                self.previous_cadences[run["id"]] = previous

    def _retry_waiting(self, run: dict[str, Any], now_s: float) -> None:
        """A run waits for a spare: once one is there (a node uncordoned or added), go on with its recovery."""
        if self.backend is None or self.choose_spare(run["id"], "") is None:
            return
        incident = self.unfinished_incident(run["id"])
        if incident is None:
            return
        failure = failure_of(incident)
        log.info("run %s: a spare is available; incident %d's recovery goes on", run["id"], incident["id"])
        self.store.update_run(run["id"], now_s, state="recovering")
        self.backend.recover(self, run["id"], incident["id"], failure, now_s)

    def unfinished_incident(self, run: str) -> dict[str, Any] | None:
        """The open failure incident of ``run`` whose recovery has not relaunched the ranks yet, if any."""
        for incident in reversed(self.store.incidents(run, state="open")):
            if incident["kind"] not in FAILURE_KINDS:
                continue
            launched = any(
                a.kind == "launch" and a.state == "done" for a in self.store.actions(incident_id=incident["id"])
            )
            if not launched:
                return dict(incident)
        return None

    # -- spares ------------------------------------------------------------------------------------------------
    def choose_spare(self, run: str, failed_node: str) -> str | None:
        """A healthy spare of ``run``, in the failed node's domain first; None when the pool is empty."""
        domain = (self.store.node(failed_node) or {}).get("domain", "")
        spares = [Spare(n["name"], True, n["domain"]) for n in self.store.nodes(run) if n["role"] == "spare"]
        chosen = select_spare(spares, domain)
        return None if chosen is None else chosen.node

    # -- reading -----------------------------------------------------------------------------------------------
    def goodput(self, run: dict[str, Any], now_s: float) -> Goodput:
        ranks = self.ranks.get(run["id"], {})
        blocking = max((r.checkpoint_blocking_s for r in ranks.values()), default=0.0)
        step = statistics.median([t for r in ranks.values() for t in r.step_times_s] or [0.0])
        interruptions = [
            Interruption(i["failed_s"], i["detected_s"], i["resumed_s"], int(i["lost_steps"] or 0), step)
            for i in self.store.incidents(run["id"])
            if i["kind"] != "straggler" and i["resumed_s"] is not None
        ]
        end = float(run["updated_s"]) if run["state"] in ("completed", "failed") else now_s
        return account(max(0.0, end - float(run["created_s"])), blocking, interruptions)

    def status(self, run_id: str, now_s: float) -> dict[str, Any] | None:
        with self.lock:
            run = self.store.run(run_id)
            if run is None:
                return None
            ranks = self.ranks.get(run_id, {})
            cadence = self.cadences.get(run_id)
            goodput = self.goodput(run, now_s)
            nodes = self.store.nodes(run_id)
            return {
                "run": run_id,
                "state": run["state"],
                "generation": run["generation"],
                "step": max((r.step for r in ranks.values()), default=run["last_step"]),
                "ranks": len(ranks),
                "mfu_ratio": statistics.mean([r.mfu_ratio for r in ranks.values()] or [0.0]),
                "tokens_per_s": max((r.job_tokens_per_s for r in ranks.values()), default=0.0),
                "ettr": goodput.ettr,
                "badput_s": {k: v for k, v in goodput.buckets().items() if k != "productive"},
                "mtbf_s": cadence.mtbf_s if cadence else None,
                "cadence": {
                    "every_steps": cadence.every_steps,
                    "from_step": cadence.from_step,
                    "reason": cadence.reason,
                }
                if cadence
                else None,
                "nodes": [{"name": n["name"], "role": n["role"], "reason": n["reason"]} for n in nodes],
                "spares_available": sum(1 for n in nodes if n["role"] == "spare"),
                "stragglers": [
                    {"rank": s.rank, "node": s.node, "slowdown_ratio": s.slowdown_ratio}
                    for s in self.stragglers.get(run_id, [])
                    if s.flagged
                ],
                "open_incidents": len(self.store.incidents(run_id, state="open")),
            }


FAILURE_KINDS = frozenset(k.value for k in FailureKind)


def failure_of(incident: dict[str, Any]) -> Failure:
    """The failure an incident row records (to go on with its recovery)."""
    return Failure(FailureKind(incident["kind"]), incident["node"], incident["rank"], incident["detail"])


def _add_sample(samples: deque[tuple[int, float, int]], slot: int, compute_s: float, steps: int) -> None:
    """Add ``steps`` steps of ``compute_s`` seconds in all to the sums of ``slot``."""
    if samples and samples[-1][0] == slot:
        _, seconds, count = samples[-1]
        samples[-1] = (slot, seconds + compute_s, count + steps)
    else:
        samples.append((slot, compute_s, steps))


def _generation_of(key: str) -> int:
    """The launch an incident key (``run/genN[/...]``) belongs to."""
    for part in key.split("/"):
        if part.startswith("gen") and part[3:].isdigit():
            return int(part[3:])
    return -1
