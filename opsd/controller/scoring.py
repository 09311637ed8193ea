"""Straggler scoring and checkpoint cadence planning, in the detection pass: the compute samples of the slots that
ended are compared among peers (``opsd.policy.stragglers``), and the run's cadence is planned from its measured
checkpoint cost, step time and failures (``opsd.policy.cadence``).

At 24,576 ranks a slot's scoring goes by parts of ``PART`` ranks (a millisecond or so of work), each followed by a
pause that leaves the interpreter to the API's thread, which waits for it after every socket call while another
computes.
"""

from __future__ import annotations

import logging
import statistics
import time
from functools import partial

from opsd.controller.incidents import NOT_FAILURES, straggler_key
from opsd.controller.live import Samples
from opsd.controller.needs import ScoringNeeds
from opsd.controller.rows import PublishedCadence, RunRow
from opsd.policy.cadence import plan_cadence
from opsd.policy.stragglers import is_straggler, peer_ratios, score_rank
from opsd.protocol.states import IncidentKind, IncidentState

log = logging.getLogger(__name__)

PART, PAUSE_S = 1024, 0.004


class Scoring:
    def __init__(self, core: ScoringNeeds) -> None:
        self.core = core

    def _score(self, run: str, now_s: float) -> None:
        """Score the compute samples of the slots that ended since the last pass (each slot once, when all its
        samples are in), and flag the ranks persistently slower than their peers."""
        with self.core.lock:
            current = self.core.slots.index(now_s)
            live = self.core.live_of(run)
            if live is None or not live.slot_ended(current):
                return
            ranks = list(live.ranks.values())
        # in parts, with pauses: heartbeats are taken in between (the API's thread needs the interpreter lock)
        for i in range(0, len(ranks), PART):
            with self.core.lock:
                live.take_samples(ranks[i : i + PART], current)
            time.sleep(PAUSE_S)
        with self.core.lock:
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
        config = self.core.config.stragglers
        flagged = []
        for rank in live.ratios.with_slow(config.persistence_ratio * config.min_samples):  # a flagged rank has these
            series, r = live.ratios.series(rank), live.ranks.get(rank)
            if r is not None and is_straggler(series, config):
                flagged.append(score_rank(rank, r.node, r.stage, series, config))
        flagged.sort(key=lambda x: (-x.slowdown_ratio, x.rank))
        with self.core.lock:
            if self.core.live_of(run) is not live:
                return  # relaunched meanwhile: these ranks are gone
            memory = self.core.remember(run)
            before = {s.rank for s in memory.stragglers}
            memory.stragglers = flagged
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
            row = self.core.store.run(run)
            generation = row.generation if row is not None else 0
            incident, _ = self.core.store.open_incident(
                key=straggler_key(run, generation, s.rank),
                run=run,
                kind=IncidentKind.STRAGGLER,
                node=s.node,
                rank=s.rank,
                detail=f"compute {s.slowdown_ratio:.2f}x the median of its peers over {s.samples} samples",
                failed_s=now_s,
                detected_s=now_s,
            )
            self.core.store.update_incident(incident, state=IncidentState.WARNED)  # a warning: nothing to recover

    def _slowest_step(self, run: str) -> int:
        """The newest step every running rank of ``run`` has reported (-1: no rank runs)."""
        with self.core.lock:
            live = self.core.live_of(run)
            ranks = live.ranks.values() if live is not None else ()
            return min((r.step for r in ranks if r.exit_code is None), default=-1)

    def adopt_cadence(self, run: RunRow, *, store_first: bool = False) -> None:
        """Take up the cadence the store says was published to the ranks of ``run`` (a controller started again, or
        one that took over, then replaces it as its predecessor would have, keeping the rule in force): when this
        controller has none, or (``store_first``: the planning, the only thread that publishes, on a row read
        after its own last write) when the store's is another's, published since."""
        stored = run.cadence
        if stored is None:
            return
        with self.core.lock:
            memory = self.core.remember(run.id)
            if memory.cadence is None or (store_first and memory.cadence != stored.current):
                memory.cadence, memory.previous_cadence = stored.current, stored.previous

    def _plan(self, run: RunRow, now_s: float) -> None:
        self.adopt_cadence(run, store_first=True)
        with self.core.lock:
            live = self.core.live_of(run.id)
            if live is None or not live.step_times_s or not live.checkpoints:
                return  # nothing measured yet: the ranks keep their local cadence
            cost_s = live.checkpoint_blocking_s / live.checkpoints
            write_s = live.checkpoint_total_s / live.checkpoints
            nodes = max(1, len(live.rank_nodes))
            step_time_s = statistics.median(live.step_times_s)
            current_step = live.newest_step
            previous = self.core.remember(run.id).cadence
        # the failures a checkpoint is for: a replica group recovered alone restored none (docs/ft.md)
        failures = [
            i for i in self.core.store.incidents(run.id) if i.kind not in NOT_FAILURES and i.replica_group is None
        ]
        node_hours = nodes * max(0.0, now_s - float(run.created_s)) / 3600.0
        plan = partial(
            plan_cadence,
            checkpoint_cost_s=cost_s,
            step_time_s=step_time_s,
            current_step=current_step,
            failures=len(failures),
            node_hours=node_hours,
            nodes=nodes,
            config=self.core.config.cadence,
            previous=previous,
            write_s=write_s,
        )
        cadence = plan(slowest_step=current_step)  # as if every rank were at the newest step
        if cadence is not previous and previous is not None:
            # one to replace: the slowest rank's step decides whether it may be now (a look at every rank, 98,304 of
            # them in ~5 ms under the lock the API's thread waits for: only when a cadence would change)
            cadence = plan(slowest_step=self._slowest_step(run.id))
        if cadence is not previous:
            self.core.store.publish_cadence(
                run.id, PublishedCadence(cadence, previous)
            )  # first: what a successor reads
            log.info(
                "run %s: checkpoint every %d steps from step %d: %s",
                run.id,
                cadence.every_steps,
                cadence.from_step,
                cadence.reason,
            )
            with self.core.lock:
                memory = self.core.remember(run.id)
                memory.cadence = cadence
                if previous is not None:
                    memory.previous_cadence = previous
