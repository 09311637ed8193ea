"""What the controller holds: its state store, its configuration, its backend, and what the heartbeats say, in
memory. The controller's parts (``intake``, ``detection``, ``operations``, ``reads``) are mixins over this core.

Durable state is in the ``StateStore``; what the heartbeats say (liveness, progress, compute samples, checkpoint
costs) is kept in memory and rebuilt within seconds after a restart. Heartbeats come in on the API's threads,
detection passes on a thread of their own, recoveries on theirs: ``lock`` guards what is in memory, and is held
only while it is read or changed, never while the store or the backend is waited on, so that heartbeats are not
held up by a pass.
"""

from __future__ import annotations

import math
import statistics
import threading
from typing import Any, Protocol

from opsd.controller.config import ControllerConfig
from opsd.controller.live import NodeLive, RankLive, Ratios, RunComms, RunLive, Window
from opsd.controller.port import Backend
from opsd.controller.state import StateStore
from opsd.policy.cadence import Cadence
from opsd.policy.detection import Failure
from opsd.policy.spares import Spare, select_spare
from opsd.policy.stragglers import StragglerScore
from opsd.protocol.states import NodeRole


class Recoveries(Protocol):
    """What the detection pass and the operator's actions ask of the recovery executor."""

    def start(self, run: str, incident_id: int, failure: Failure, now_s: float) -> None:
        """Carry out (or go on with) the recovery of ``run`` from ``failure``, without blocking the caller."""
        ...


class ControllerCore:
    recovery: Recoveries

    def __init__(
        self, store: StateStore, config: ControllerConfig | None = None, backend: Backend | None = None
    ) -> None:
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

    # -- the ranks' policy -------------------------------------------------------------------------------------
    def add_command(self, run: str, command: dict[str, Any]) -> None:
        """Put ``command`` (``{"id", "name"[, "ranks"]}``) in the policy of ``run``'s ranks, once per id."""
        with self.lock:
            commands = self.commands.setdefault(run, [])
            if all(c["id"] != command["id"] for c in commands):
                commands.append(dict(command))

    def remove_command(self, run: str, command_id: str) -> None:
        with self.lock:
            self.commands[run] = [c for c in self.commands.get(run, []) if c["id"] != command_id]

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

    # -- ranks and launches ------------------------------------------------------------------------------------
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

    def running_ranks(self, run: str) -> list[int]:
        """The ranks of the run's current launch heard from and not exited."""
        with self.lock:
            live = self.runs_live.get(run)
            return sorted(r for r in live.ranks if r not in live.exited) if live is not None else []

    def ranks_ended(self, run: str) -> bool:
        """Whether a rank of the run's current launch has exited (the backend said so)."""
        with self.lock:
            live = self.runs_live.get(run)
            return bool(live is not None and live.exited)

    def launched(self, run: str, now_s: float) -> None:
        """The backend says the new launch runs: what agents report from before ``now_s`` belongs to the old one.
        (On a cluster a stopped rank may go on reporting for its grace period, after the relaunch began; the
        relaunch is done only once the old ranks are gone.)"""
        with self.lock:
            self.runs_live.pop(run, None)
            self.stragglers.pop(run, None)
            self.launched_s[run] = now_s

    def forget_ranks(self, run: str, now_s: float) -> None:
        """A relaunch: the ranks of ``run`` start over (their progress and samples belong to the old launch); what
        agents report from before ``now_s`` is ignored."""
        with self.lock:
            ended = self.runs_live.pop(run, None)
            self.ended_step[run] = ended.newest_step if ended is not None else -1
            self.stragglers.pop(run, None)
            self.launched_s[run] = now_s

    # -- spares ------------------------------------------------------------------------------------------------
    def choose_spare(self, run: str, failed_node: str) -> str | None:
        """A healthy spare of ``run``'s pool (its own spares, and the cluster's pool: spares of no run), in the
        failed node's domain first; None when the pool is empty."""
        domain = (self.store.node(failed_node) or {}).get("domain", "")
        with self.lock:  # a spare whose GPUs reported an event that calls for an action is not healthy
            faulty = {name for name, live in self.nodes.items() if live.events}
        spares = [Spare(n["name"], n["name"] not in faulty, n["domain"]) for n in self.spare_pool(run)]
        chosen = select_spare(spares, domain)
        return None if chosen is None else chosen.node

    def spare_pool(self, run: str) -> list[dict[str, Any]]:
        """The spare nodes ``run`` may take: its own, and the shared pool's (nodes of no run)."""
        return [n for n in self.store.nodes() if n["role"] == NodeRole.SPARE and n["run"] in (run, None)]
