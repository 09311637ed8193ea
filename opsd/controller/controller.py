"""The controller: takes the agents' heartbeats, detects failures and stragglers, keeps incidents, publishes the
checkpoint cadence, and drives a backend through recoveries.

Durable state is in the ``Store``; what the heartbeats say (liveness, progress, compute samples, checkpoint
costs) is kept in memory and rebuilt within seconds after a restart. Decisions are the pure functions of
``opsd.policy``; this module gathers their inputs, applies their outputs, and logs one line per decision.
Time comes in as ``now_s`` (the controller's wall clock), so tests drive it.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from opsd.controller.live import NodeLive, RankLive, Ratios, RunComms, RunLive, Samples, Window
from opsd.controller.state import Store
from opsd.errors import PermanentError
from opsd.policy.cadence import Cadence, CadenceConfig, plan_cadence
from opsd.policy.detection import (
    CollectiveTimeout,
    DetectionConfig,
    Failure,
    FailureKind,
    GpuEvent,
    detect_failures,
)
from opsd.policy.goodput import Goodput, Interruption, account
from opsd.policy.spares import Spare, select_spare
from opsd.policy.stragglers import StragglerConfig, StragglerScore, is_straggler, peer_ratios, score_rank

log = logging.getLogger(__name__)

ACTIONABLE_EVENTS = ("cordon_and_swap", "restart_job")
XID_CLOCK_SLACK_S = 60.0  # an XID's failure time is its event time, but no earlier than this before detection
# a slot's scoring goes by parts of this many ranks (a millisecond or so of work), each followed by a pause that
# leaves the interpreter to the API's thread (which waits for it after every socket call while another computes)
PART, PAUSE_S = 1024, 0.004


@dataclass(frozen=True)
class ControllerConfig:
    detection: DetectionConfig = field(default_factory=DetectionConfig)
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    cadence: CadenceConfig = field(default_factory=CadenceConfig)
    sample_slot_s: float = 2.0  # compute samples of ranks are compared within slots of this length
    history: int = 64  # heartbeat intervals and step times kept per node / rank
    run_history: int = 4096  # step times kept per run, of any rank: its median step time is theirs
    restart_lead_s: float = 5.0  # a graceful restart's checkpoint is asked for this far ahead of the newest step
    restart_min_lead_steps: int = 3
    restart_checkpoint_wait_s: float = 120.0  # how long a graceful restart waits for its checkpoint to commit
    spare_window_h: float = 24.0  # how long a failed node stays out (repair): the spare pool covers this window
    spare_risk: float = 0.01  # accepted chance that more nodes fail within the window than there are spares
    flight_wait_s: float = 10.0  # how long a hang's recovery waits for the ranks' Flight Recorder dumps

    def __post_init__(self) -> None:
        if self.sample_slot_s <= 0:
            raise ValueError("controller.sample_slot_s must be > 0")
        if self.history < 2 or self.run_history < 2:
            raise ValueError("controller.history and controller.run_history must be >= 2")
        if self.restart_lead_s < 0 or self.restart_min_lead_steps < 1 or self.restart_checkpoint_wait_s < 0:
            raise ValueError("controller.restart_lead_s, restart_checkpoint_wait_s must be >= 0, min lead steps >= 1")
        if self.flight_wait_s < 0:
            raise ValueError("controller.flight_wait_s must be >= 0")
        if self.spare_window_h <= 0 or not 0 < self.spare_risk < 1:
            raise ValueError("controller.spare_window_h must be > 0 and controller.spare_risk between 0 and 1")


class Backend(Protocol):
    """What the controller asks of the machines (local processes, or Kubernetes). Every call is idempotent for a
    given ``request_id``: the controller may repeat one after a restart."""

    def recover(self, controller: Controller, run: str, incident_id: int, failure: Failure, now_s: float) -> None:
        """Carry out (or go on with) the recovery of ``run`` from ``failure``, without blocking the caller."""
        ...

    def resumed_from_step(self, run: str) -> int | None:
        """The checkpoint step the current launch resumed from, when the backend knows it."""
        ...


class Controller:
    """Heartbeats come in on the API's threads, detection passes on a thread of their own (and on ``opsd run``'s
    loop), recoveries on the backend's: ``lock`` guards what is in memory, and is held only while it is read or
    changed, never while the store or the backend is waited on, so that heartbeats are not held up by a pass."""

    def __init__(self, store: Store, config: ControllerConfig | None = None, backend: Backend | None = None) -> None:
        self.store = store
        self.config = config or ControllerConfig()
        self.backend = backend
        self.lock = threading.RLock()
        self.ticking = threading.Lock()  # one detection pass at a time
        self.nodes: dict[str, NodeLive] = {}
        self.runs_live: dict[str, RunLive] = {}
        self.cadences: dict[str, Cadence] = {}
        self.previous_cadences: dict[str, Cadence] = {}  # in force before the current one's from_step
        self.stragglers: dict[str, list[StragglerScore]] = {}  # run -> the ranks flagged now
        self.heartbeats_total = 0
        self.launched_s: dict[str, float] = {}  # run -> when its current launch started
        self.known_runs: set[str] = set()  # runs the store has (recorded once, not at every heartbeat)
        self.checkpoint_at: dict[str, int] = {}  # run -> a one-off checkpoint step asked for (a graceful restart)
        self.commands: dict[str, list[dict[str, Any]]] = {}  # run -> commands for its ranks (docs/protocol.md)
        self.progressed_s: dict[str, float] = {}  # run -> when its newest step last advanced
        self.ended_step: dict[str, int] = {}  # run -> the newest step of its previous launch (-1: unknown)
        self.checkpointed_s: dict[str, float] = {}  # run -> when every rank had finished one more checkpoint
        self.comms: dict[str, RunComms] = {}  # run -> its collective seconds per node and stack (the flame graph)

    @property
    def ranks(self) -> dict[str, dict[int, RankLive]]:
        """run -> rank -> what its heartbeats say."""
        return {run: live.ranks for run, live in self.runs_live.items()}

    def _run_live(self, run: str) -> RunLive:
        live = self.runs_live.get(run)
        if live is None:
            stragglers = self.config.stragglers
            live = RunLive(Window(self.config.run_history), Ratios(stragglers.window, stragglers.threshold_ratio))
            self.runs_live[run] = live
        return live

    # -- heartbeats --------------------------------------------------------------------------------------------
    def heartbeat(self, body: dict[str, Any], now_s: float) -> dict[str, Any]:
        """Take one validated heartbeat (``docs/protocol.md``); the reply: events acknowledged, and the policy."""
        node = str(body["node"])
        events = body.get("events", [])
        runs = sorted({str(r["run"]) for r in body.get("ranks", [])})
        # the store first, without the lock (written only when something is new: a run, a node, events)
        for run in runs:
            if run not in self.known_runs:
                if self.store.create_run(run, {"observed": True}, now_s):
                    log.info("run %s first seen in a heartbeat from node %s", run, node)
                self.known_runs.add(run)
        known = self.store.node(node)
        if runs and (known is None or known["run"] is None):
            self.store.upsert_node(node, now_s, run=runs[0], role="active")
            known = self.store.node(node)
        acked = int(known["events_acked"]) if known else 0
        run_of_node = known["run"] if known else None
        with self.lock:
            self.heartbeats_total += 1
            live = self.nodes.get(node)
            if live is None:
                live = self.nodes[node] = NodeLive(node, now_s, Window(self.config.history))
            else:
                live.intervals_s.append(now_s - live.last_heartbeat_s)
                live.last_heartbeat_s = now_s
            for e in events:
                if int(e["seq"]) > acked and e["action"] in ACTIONABLE_EVENTS:
                    live.events.setdefault(
                        int(e["seq"]), GpuEvent(node, e["gpu"], e["xid"], e["action"], e["reason"], e.get("time_s"))
                    )
            for r in body.get("ranks", []):
                self._rank(r, node, now_s)
            for t in body.get("timeouts", []):
                self._timeout(t, node)
            if body.get("comms"):
                self._comms(body["comms"], node)
            # events that need no action are acknowledged at once; the others once their incident is recorded
            newest = max((int(e["seq"]) for e in events), default=acked)
            ack = min(live.events) - 1 if live.events else max(acked, newest)
            reply: dict[str, Any] = {"ack_events_up_to": ack}
            policy = self._policy(run_of_node) if run_of_node is not None else {}
            if policy:
                reply["policy"] = policy
        if ack > acked:
            self.store.ack_events(node, ack, now_s)
        return reply

    def _policy(self, run: str) -> dict[str, Any]:
        """The policy for the ranks of ``run`` (docs/protocol.md); called with the lock held."""
        policy: dict[str, Any] = {}
        if run in self.cadences:
            c = self.cadences[run]
            checkpoint: dict[str, Any] = {"every_steps": c.every_steps, "from_step": c.from_step}
            if run in self.previous_cadences:
                p = self.previous_cadences[run]
                checkpoint["previous"] = {"every_steps": p.every_steps, "from_step": p.from_step}
            policy["checkpoint"] = checkpoint
        if run in self.checkpoint_at:
            policy["checkpoint_at_step"] = self.checkpoint_at[run]
        if run in self.commands:  # once a run had one, an empty list: agents then rewrite a file that held one
            policy["commands"] = list(self.commands[run])
        return policy

    def add_command(self, run: str, command: dict[str, Any]) -> None:
        """Put ``command`` (``{"id", "name"[, "ranks"]}``) in the policy of ``run``'s ranks, once per id."""
        with self.lock:
            commands = self.commands.setdefault(run, [])
            if all(c["id"] != command["id"] for c in commands):
                commands.append(dict(command))

    def remove_command(self, run: str, command_id: str) -> None:
        with self.lock:
            self.commands[run] = [c for c in self.commands.get(run, []) if c["id"] != command_id]

    def _comms(self, rows: list[list[Any]], node: str) -> None:
        """A node's collective totals per run (cumulative): they replace its last ones; runs the store does not
        have are ignored (memory holds real runs only)."""
        by_run: dict[str, list[list[Any]]] = {}
        for row in rows:
            by_run.setdefault(row[0], []).append(row)
        for run, of_run in by_run.items():
            if run in self.known_runs:
                held = self.comms.get(run)
                if held is None:
                    held = self.comms[run] = RunComms()
                held.update(node, of_run)

    def comm_seconds(self, run: str) -> dict[tuple[str, str, str], float]:
        """The run's collective seconds by (phase, dimension, op), summed over its nodes since their agents
        started (docs/flamegraph.md)."""
        with self.lock:
            held = self.comms.get(run)
            return held.totals() if held is not None else {}

    def heartbeat_writes(self, body: dict[str, Any]) -> bool:
        """Whether taking ``body`` may write to the store (its node or a run of it is new, or it carries events);
        the others are taken in memory alone."""
        known = self.store.node(str(body["node"]))
        if known is None or known["run"] is None or body.get("events"):
            return True
        return any(r["run"] not in self.known_runs for r in body.get("ranks", []))

    def _rank(self, r: dict[str, Any], node: str, now_s: float) -> None:
        run, rank = str(r["run"]), int(r["rank"])
        if float(r.get("last_report_unix_s", now_s)) < self.launched_s.get(run, 0.0):
            return  # the agent still remembers a rank of an earlier launch
        run_live = self._run_live(run)
        live = run_live.ranks.get(rank)
        if live is None or live.node != node:
            live = RankLive(rank, node, -1, now_s, Window(self.config.history))
            run_live.place(live)
        live.stage = int(r.get("coords", {}).get("pp", 0))
        step = int(r["step"])
        slot = int(now_s // self.config.sample_slot_s)
        steps_total, compute_total_s = int(r.get("steps_total", 0)), float(r.get("compute_total_s", 0.0))
        if steps_total:  # the agent's running sums: the mean compute of the steps since the last heartbeat
            steps_before, compute_before_s = live.steps_total, live.compute_total_s
            live.steps_total, live.compute_total_s = steps_total, compute_total_s
            if 0 <= steps_before < steps_total and compute_total_s >= compute_before_s:
                run_live.add_sample(live, slot, compute_total_s - compute_before_s, steps_total - steps_before)
        if step != live.step:
            if step > live.step >= 0:
                step_s = float(r["step_s"])
                live.step_times_s.append(step_s)
                run_live.step_times_s.append(step_s)
                if not steps_total:  # an agent without running sums: the last step's compute
                    run_live.add_sample(live, slot, float(r.get("compute_s", step_s)), 1)
            live.step = step
            live.progress_s = now_s
            live.timeout = ""  # it stepped on: whatever it waited on is over
            run_live.waiting.discard(rank)
            run_live.newest_step = max(run_live.newest_step, step)
            run_live.latest_progress_s = max(run_live.latest_progress_s, now_s)
        live.mfu_ratio = float(r.get("mfu_ratio", 0.0))
        live.job_tokens_per_s = float(r.get("job_tokens_per_s", 0.0))
        checkpoints = int(r.get("checkpoints", 0))
        if checkpoints != live.checkpoints:
            run_live.count_checkpoints(live, checkpoints, float(r.get("checkpoint_blocking_s", 0.0)))
            if run_live.checkpoints >= len(run_live.ranks) * (run_live.checkpoints_done + 1):
                run_live.checkpoints_done = run_live.checkpoints // len(run_live.ranks)
                self.checkpointed_s[run] = now_s  # the last rank finished its save: the checkpoint is committed

    def _timeout(self, t: dict[str, Any], node: str) -> None:
        run, rank = str(t["run"]), int(t["rank"])
        run_live = self.runs_live.get(run)
        live = run_live.ranks.get(rank) if run_live is not None else None
        if (
            run_live is None
            or live is None
            or live.node != node
            or float(t["time_unix_s"]) < self.launched_s.get(run, 0.0)
        ):
            return  # a rank of an earlier launch, or one not heard from yet
        if int(t["step"]) >= live.step:  # still waiting in the step after its last report
            live.timeout = f"rank {rank} waited {float(t['waited_s']):.0f} s in {t['op']} on {t['dim']}"
            run_live.waiting.add(rank)

    def rank_exited(self, run: str, rank: int, node: str, exit_code: int, now_s: float) -> None:
        """The backend saw a rank process end."""
        with self.lock:
            run_live = self._run_live(run)
            live = run_live.ranks.get(rank)
            if live is None:
                live = RankLive(rank, node, -1, now_s, Window(2))
                run_live.place(live)
            live.exit_code = exit_code
            run_live.exited.add(rank)

    def forget_ranks(self, run: str, now_s: float) -> None:
        """A relaunch: the ranks of ``run`` start over (their progress and samples belong to the old launch); what
        agents report from before ``now_s`` is ignored."""
        with self.lock:
            ended = self.runs_live.pop(run, None)
            self.ended_step[run] = ended.newest_step if ended is not None else -1
            self.stragglers.pop(run, None)
            self.launched_s[run] = now_s

    # -- decisions ---------------------------------------------------------------------------------------------
    def tick(self, now_s: float) -> list[Failure]:
        """Detect failures of running runs and start their recovery; score stragglers; plan cadences."""
        found: list[Failure] = []
        with self.ticking:
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

    def _detect(self, run: str, now_s: float) -> list[Failure]:
        active = self.store.node_names(run, "active")
        with self.lock:
            live = self.runs_live.get(run)
            names = active | live.rank_nodes.keys() if live is not None else active
            nodes = [self.nodes[n] for n in names if n in self.nodes]
            events = [e for n in nodes for e in n.events.values()]
            if (live is None or not live.ranks) and not events:
                return []
            ranks: Iterable[RankLive] = ()
            timeouts = []
            if live is not None:
                # every rank only when one may have failed: it exited, waits on a collective, or no rank stepped
                # within the hang floor (a hang is never detected sooner); else none of them can be a failure
                quiet = now_s - live.latest_progress_s <= self.config.detection.hang_floor_s
                if live.exited or live.waiting or not quiet:
                    ranks = live.ranks.values()
                for rank in sorted(live.waiting):
                    r = live.ranks[rank]
                    timeouts.append(CollectiveTimeout(rank, r.node, r.timeout))
            return detect_failures(
                now_s=now_s,
                nodes=nodes,
                ranks=ranks,
                events=events,
                timeouts=timeouts,
                step_times_s=live.step_times_s if live is not None else (),
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
        with self.lock:
            live = self.runs_live.get(run["id"])
            newest = live.newest_step if live is not None else -1
        if newest < 0:
            return
        earlier = [
            i
            for i in self.store.incidents(run["id"], state="open")
            if _generation_of(i["key"]) < int(run["generation"])
        ]
        if earlier:
            with self.lock:
                ranks = [r for r in live.ranks.values() if r.step >= 0] if live is not None else []
                first = min((r.step for r in ranks), default=-1)
                resumed_s = min((r.progress_s for r in ranks), default=now_s)
            if first < 0:
                return
            for incident in earlier:
                resumed_from = self.backend.resumed_from_step(run["id"]) if self.backend is not None else None
                if resumed_from is None:
                    resumed_from = max(0, first - 1)
                # the steps the failed launch had made past the checkpoint (not the run's best: an earlier
                # launch may have got further and lost more, which its own incident counted)
                before = self.ended_step.get(run["id"], -1)
                lost = max(0, (before if before >= 0 else int(run["last_step"])) - resumed_from)
                self.store.update_incident(
                    incident["id"],
                    state="recovered",
                    resumed_s=resumed_s,
                    resumed_from_step=resumed_from,
                    lost_steps=lost,
                )
                log.info(
                    "run %s: incident %d recovered: resumed from step %d, %d steps lost, %.1f s after detection",
                    run["id"],
                    incident["id"],
                    resumed_from,
                    lost,
                    resumed_s - incident["detected_s"],
                )
        if newest > int(run["last_step"]):
            self.store.update_run(run["id"], now_s, last_step=newest)
            self.progressed_s[run["id"]] = now_s

    def request_restart(self, run_id: str, reason: str, now_s: float) -> dict[str, Any]:
        """An operator's restart of every rank of a running run: recorded as a ``manual_restart`` incident and
        carried out by the backend (a checkpoint first, when the ranks are progressing). Raises ``PermanentError``
        when the run is unknown or not running, or a recovery is under way."""
        run = self.store.run(run_id)
        if run is None:
            raise PermanentError(f"no run {run_id!r}")
        if self.backend is None:
            raise PermanentError("this controller has no backend to restart ranks with")
        if run["state"] != "running":
            raise PermanentError(f"run {run_id!r} is {run['state']}: only a running run can be restarted")
        cause = Failure(FailureKind.MANUAL_RESTART, "", None, f"restart asked: {reason}")
        incident, new = self.store.open_incident(
            key=f"{run_id}/gen{run['generation']}",
            run=run_id,
            kind=cause.kind.value,
            node="",
            rank=None,
            detail=cause.detail,
            failed_s=now_s,
            detected_s=now_s,
        )
        if not new:
            raise PermanentError(f"run {run_id!r} is already recovering (incident {incident})")
        log.warning("run %s: incident %d: %s", run_id, incident, cause.detail)
        self.store.update_run(run_id, now_s, state="recovering")
        self.backend.recover(self, run_id, incident, cause, now_s)
        found = self.store.incident(incident)
        assert found is not None
        return found

    def checkpoint_step_ahead(self, run: str) -> int | None:
        """A step far enough ahead that every rank has read a policy naming it before it gets there (the one-off
        checkpoint of a graceful restart); None when the run's ranks are not progressing."""
        with self.lock:
            live = self.runs_live.get(run)
            if live is None or not live.step_times_s or live.newest_step < 0:
                return None
            step_s = statistics.median(live.step_times_s)
            newest = live.newest_step
        lead = max(self.config.restart_min_lead_steps, math.ceil(self.config.restart_lead_s / max(step_s, 1e-6)))
        return newest + lead

    def ask_checkpoint(self, run: str, step: int | None) -> None:
        """Publish (or, with None, withdraw) a one-off checkpoint at ``step`` in the policy of ``run``."""
        with self.lock:
            if step is None:
                self.checkpoint_at.pop(run, None)
            else:
                self.checkpoint_at[run] = step

    def _failed_at(self, run: str, cause: Failure, now_s: float) -> float:
        """When the failure happened, as well as the controller can tell: the last sign of life."""
        with self.lock:
            if cause.kind is FailureKind.HEARTBEAT_LOSS and cause.node in self.nodes:
                return self.nodes[cause.node].last_heartbeat_s
            if cause.kind in (FailureKind.FATAL_XID, FailureKind.APPLICATION_XID) and cause.node in self.nodes:
                seen = [e.time_s for e in self.nodes[cause.node].events.values() if e.time_s is not None]
                # the agent's time of the event, within reason (a node's clock may be off; an old event resent)
                return max(min(min(seen, default=now_s), now_s), now_s - XID_CLOCK_SLACK_S)
            if cause.kind is FailureKind.HANG:
                live = self.runs_live.get(run)
                return max((r.progress_s for r in live.ranks.values()), default=now_s) if live else now_s
            return now_s

    def _handled_events(self, cause: Failure, now_s: float) -> None:
        if cause.kind not in (FailureKind.FATAL_XID, FailureKind.APPLICATION_XID):
            return
        with self.lock:
            live = self.nodes.get(cause.node)
            if live is None or not live.events:
                return
            newest = max(live.events)
        self.store.ack_events(cause.node, newest, now_s)  # first: a heartbeat now does not add them again
        with self.lock:
            for seq in [seq for seq in live.events if seq <= newest]:
                del live.events[seq]

    def _score(self, run: str, now_s: float) -> None:
        """Score the compute samples of the slots that ended since the last pass (each slot once, when all its
        samples are in), and flag the ranks persistently slower than their peers."""
        current = int(now_s // self.config.sample_slot_s)
        with self.lock:
            live = self.runs_live.get(run)
            if live is None or not live.slot_ended(current):
                return
            ranks = list(live.ranks.values())
        # in parts, with pauses: heartbeats are taken in between (the API's thread needs the interpreter lock)
        for i in range(0, len(ranks), PART):
            with self.lock:
                live.take_samples(ranks[i : i + PART], current)
            time.sleep(PAUSE_S)
        with self.lock:
            taken, live.finished = live.finished, Samples()
        after, live.scored_slot = live.scored_slot, current - 1
        # the ratios belong to this pass alone (passes take turns): computed without the lock, a stage at a time
        for slot, stages in sorted(taken.by_slot.items()):
            if after is not None and slot <= after:
                continue
            for ranks_of_stage, compute_s in stages.values():
                ratios = peer_ratios(compute_s)
                for i in range(0, len(ratios), PART):
                    live.ratios.add(ranks_of_stage[i : i + PART], ratios[i : i + PART])
                    time.sleep(PAUSE_S)
        config = self.config.stragglers
        flagged = []
        for rank in live.ratios.with_slow(config.persistence_ratio * config.min_samples):  # a flagged rank has these
            series, r = live.ratios.series(rank), live.ranks.get(rank)
            if r is not None and is_straggler(series, config):
                flagged.append(score_rank(rank, r.node, r.stage, series, config))
        flagged.sort(key=lambda x: (-x.slowdown_ratio, x.rank))
        with self.lock:
            if self.runs_live.get(run) is not live:
                return  # relaunched meanwhile: these ranks are gone
            before = {s.rank for s in self.stragglers.get(run, [])}
            self.stragglers[run] = flagged
        for s in flagged:
            if s.rank in before:
                continue
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

    def _plan(self, run: dict[str, Any], now_s: float) -> None:
        with self.lock:
            live = self.runs_live.get(run["id"])
            if live is None or not live.step_times_s or not live.checkpoints:
                return  # nothing measured yet: the ranks keep their local cadence
            cost_s = live.checkpoint_blocking_s / live.checkpoints
            nodes = max(1, len(live.rank_nodes))
            step_time_s = statistics.median(live.step_times_s)
            current_step = live.newest_step
            previous = self.cadences.get(run["id"])
        failures = [i for i in self.store.incidents(run["id"]) if i["kind"] != "straggler"]
        node_hours = nodes * max(0.0, now_s - float(run["created_s"])) / 3600.0
        cadence = plan_cadence(
            checkpoint_cost_s=cost_s,
            step_time_s=step_time_s,
            current_step=current_step,
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
            with self.lock:
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
        with self.lock:  # a spare whose GPUs reported an event that calls for an action is not healthy
            faulty = {name for name, live in self.nodes.items() if live.events}
        spares = [
            Spare(n["name"], n["name"] not in faulty, n["domain"])
            for n in self.store.nodes(run)
            if n["role"] == "spare"
        ]
        chosen = select_spare(spares, domain)
        return None if chosen is None else chosen.node

    # -- reading -----------------------------------------------------------------------------------------------
    def goodput(self, run: dict[str, Any], now_s: float, incidents: list[dict[str, Any]] | None = None) -> Goodput:
        """Where the run's wall time went; ``incidents``: its incidents, when the caller has them already."""
        if incidents is None:
            incidents = self.store.incidents(run["id"])
        with self.lock:
            live = self.runs_live.get(run["id"])
            ranks = live.ranks.values() if live is not None else ()
            blocking = max((r.checkpoint_blocking_s for r in ranks), default=0.0)
            step = statistics.median(live.step_times_s) if live is not None and live.step_times_s else 0.0
        interruptions = [
            Interruption(i["failed_s"], i["detected_s"], i["resumed_s"], int(i["lost_steps"] or 0), step)
            for i in incidents
            if i["kind"] != "straggler" and i["resumed_s"] is not None
        ]
        end = float(run["updated_s"]) if run["state"] in ("completed", "failed") else now_s
        return account(max(0.0, end - float(run["created_s"])), blocking, interruptions)

    def status(self, run_id: str, now_s: float) -> dict[str, Any] | None:
        run = self.store.run(run_id)
        if run is None:
            return None
        nodes = self.store.nodes(run_id)
        incidents = self.store.incidents(run_id)
        goodput = self.goodput(run, now_s, incidents)
        with self.lock:
            live = self.runs_live.get(run_id)
            ranks = list(live.ranks.values()) if live is not None else []
            cadence = self.cadences.get(run_id)
            stragglers = list(self.stragglers.get(run_id, []))
            step = max((r.step for r in ranks), default=run["last_step"])
            mfu_ratio = math.fsum(r.mfu_ratio for r in ranks) / len(ranks) if ranks else 0.0
            tokens_per_s = max((r.job_tokens_per_s for r in ranks), default=0.0)
        return {
            "run": run_id,
            "state": run["state"],
            "generation": run["generation"],
            "step": step,
            "ranks": len(ranks),
            "mfu_ratio": mfu_ratio,
            "tokens_per_s": tokens_per_s,
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
                {"rank": s.rank, "node": s.node, "slowdown_ratio": s.slowdown_ratio} for s in stragglers if s.flagged
            ],
            "open_incidents": sum(1 for i in incidents if i["state"] == "open"),
        }


FAILURE_KINDS = frozenset(k.value for k in FailureKind)


def failure_of(incident: dict[str, Any]) -> Failure:
    """The failure an incident row records (to go on with its recovery)."""
    return Failure(FailureKind(incident["kind"]), incident["node"], incident["rank"], incident["detail"])


def _generation_of(key: str) -> int:
    """The launch an incident key (``run/genN[/...]``) belongs to."""
    for part in key.split("/"):
        if part.startswith("gen") and part[3:].isdigit():
            return int(part[3:])
    return -1
