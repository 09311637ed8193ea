"""The controller's read models of a run: where its time went (goodput) and its status, as the API and the CLI
show them. Read-only; the larger views (spare pools, checkpoints, cadence, the post-mortem bundle) are in
``opsd.controller.views``."""

from __future__ import annotations

import math
import statistics

from opsd.controller.live import RankLive
from opsd.controller.needs import ReadsNeeds
from opsd.controller.rows import LaunchRow, RunRow, pipeline_view
from opsd.controller.spares import spare_pool
from opsd.policy.goodput import BadputBucket, Goodput, Interruption, Startup, account
from opsd.policy.pipeline import run_bubble
from opsd.protocol.answers import (
    AgentDown,
    LastMeasured,
    Maintenance,
    NodeEntry,
    PlannedCadence,
    ReplicaGroups,
    RunAverage,
    RunStatus,
    Straggler,
)
from opsd.protocol.records import IncidentRow
from opsd.protocol.states import WARNING_KINDS, IncidentState, RunState


class Reads:
    def __init__(self, core: ReadsNeeds) -> None:
        self.core = core

    def goodput(self, run: RunRow, now_s: float, incidents: list[IncidentRow] | None = None) -> Goodput:
        """Where the run's wall time went, from its start (its launch and initialisation up to its first productive
        step are ``startup`` badput); ``incidents``: its incidents, when the caller has them already."""
        if incidents is None:
            incidents = self.core.store.incidents(run.id)
        with self.core.lock:
            live = self.core.live_of(run.id)
            ranks = live.ranks.values() if live is not None else ()
            blocking = max((r.checkpoint_blocking_s for r in ranks), default=0.0)
            step = statistics.median(live.step_times_s) if live is not None and live.step_times_s else 0.0
        groups = run.spec.replica_groups
        # a replica recovery stopped its group's share of the job; its lost steps are those the other groups discarded
        interruptions = [
            Interruption(
                i.failed_s,
                i.detected_s,
                i.resumed_s,
                int(i.lost_steps or 0) if i.replica_group is None else 0,
                step,
                share=1.0 / groups if i.replica_group is not None else 1.0,
                stall_s=i.stall_s or 0.0,
                discarded_steps=int(i.lost_steps or 0) if i.replica_group is not None else 0,
            )
            for i in incidents
            if i.kind not in WARNING_KINDS and i.resumed_s is not None
        ]
        end = float(run.updated_s) if run.state in (RunState.COMPLETED, RunState.FAILED) else now_s
        startup = Startup(float(run.created_s), run.first_productive_s)
        return account(max(0.0, end - startup.started_s), blocking, interruptions, startup)

    def status(self, run_id: str, now_s: float) -> RunStatus | None:
        """The run's state, step, MFU, tokens/s, ETTR and badput, cadence, nodes, spares, stragglers and the nodes
        whose agent is down while their ranks train; None when there is no such run."""
        run = self.core.store.run(run_id)
        if run is None:
            return None
        nodes = self.core.store.nodes(run_id)
        incidents = self.core.store.incidents(run_id)
        hold = self.core.holds.of(run_id)
        goodput = self.goodput(run, now_s, incidents)
        with self.core.lock:
            live = self.core.live_of(run_id)
            ranks = list(live.ranks.values()) if live is not None else []
            memory = self.core.memory.get(run_id)
            cadence = memory.cadence if memory is not None else None
            stragglers = list(memory.stragglers) if memory is not None else []
            agents_down = list(memory.agents_down) if memory is not None else []
            step = max((r.step for r in ranks if r.step >= 0), default=run.last_step)
            mfu_ratio = math.fsum(r.mfu_ratio for r in ranks) / len(ranks) if ranks else 0.0
            tokens_per_s = max((r.job_tokens_per_s for r in ranks), default=0.0)
            bubble = run_bubble((r.bubble for r in ranks if r.bubble is not None), self.core.config.pipeline)
        if run.final_step is not None and RunState(run.state).finished:
            step = int(run.final_step)  # where it ended, whatever its last launch reported
        last, average = measured(self.core.store.launches(run_id))
        return RunStatus(
            run=run_id,
            state=run.state,
            generation=run.generation,
            step=step,
            ranks=len(ranks),
            mfu_ratio=mfu_ratio,
            tokens_per_s=tokens_per_s,
            ettr=goodput.ettr,
            badput_s={k: v for k, v in goodput.buckets().items() if k != BadputBucket.PRODUCTIVE},
            mtbf_s=cadence.mtbf_s if cadence else None,
            cadence=PlannedCadence(every_steps=cadence.every_steps, from_step=cadence.from_step, reason=cadence.reason)
            if cadence
            else None,
            nodes=tuple(NodeEntry(name=n.name, role=n.role, reason=n.reason) for n in nodes),
            spares_available=len(spare_pool(self.core.store, run_id)),  # its own and the shared pool's
            stragglers=tuple(
                Straggler(rank=s.rank, node=s.node, slowdown_ratio=s.slowdown_ratio) for s in stragglers if s.flagged
            ),
            agents_down=tuple(AgentDown(node=d.node, detail=d.detail) for d in agents_down),
            maintenance=None
            if hold is None
            else Maintenance(every_run=hold.run is None, reason=hold.reason, since_s=hold.since_s),
            open_incidents=sum(1 for i in incidents if i.state == IncidentState.OPEN),
            pipeline=pipeline_view(bubble),
            replicas=self._replicas_view(run, incidents, ranks),
            last_measured=last,
            run_average=average,
        )

    def _replicas_view(self, run: RunRow, incidents: list[IncidentRow], ranks: list[RankLive]) -> ReplicaGroups | None:
        """A fault-tolerant run's replica groups (None for another run): how many, the quorum's minimum, those in
        service and those out (stopped by a recovery, or waiting for a node), the groups in the newest quorum its
        ranks reported, and the steps each group missed while it was out (over its replica recoveries)."""
        layout = run.spec.replicas
        if not layout.fault_tolerant:
            return None
        with self.core.lock:
            memory = self.core.memory.get(run.id)
            down = set(memory.groups_down) if memory is not None else set()
        out = sorted({g for g, launch in run.groups.items() if launch.out} | down)
        missed: dict[str, int] = {}
        for i in incidents:
            if i.replica_group is not None and i.missed_steps:
                missed[str(i.replica_group)] = missed.get(str(i.replica_group), 0) + i.missed_steps
        return ReplicaGroups(
            groups=layout.groups,
            min_replicas=layout.min_replicas,
            in_service=tuple(g for g in range(layout.groups) if g not in out),
            out=tuple(out),
            quorum_replica_groups=max((r.quorum_replicas for r in ranks), default=None),
            missed_steps=missed,
        )


def measured(launches: list[LaunchRow]) -> tuple[LastMeasured | None, RunAverage | None]:
    """What the run's launches measured, as recorded: the last sample of the job's MFU and tokens/s (of which launch,
    and when), and their averages over every sample taken while the ranks progressed; None before any sample (a
    finished run keeps them)."""
    last = next((row for row in reversed(launches) if row.mfu_ratio_last is not None), None)
    samples = sum(int(row.samples) for row in launches)
    piped = next((row for row in reversed(launches) if row.pipeline is not None), None)
    bubble_samples = sum(int(row.bubble_samples or 0) for row in launches)
    last_measured = None
    if last is not None:
        last_measured = LastMeasured(
            launch=last.generation,
            mfu_ratio=last.mfu_ratio_last,
            tokens_per_s=last.tokens_per_s_last,
            at_unix_s=last.updated_s,
            # the pipeline bubble of the last launch that had one (its launch: ``pipeline_launch``)
            pipeline=piped.pipeline if piped is not None else None,
            pipeline_launch=piped.generation if piped is not None else None,
        )
    if not samples:
        return last_measured, None
    average = RunAverage(
        mfu_ratio=math.fsum(row.mfu_ratio_sum for row in launches) / samples,
        tokens_per_s=math.fsum(row.tokens_per_s_sum for row in launches) / samples,
        samples=samples,
        bubble_ratio=math.fsum(row.bubble_ratio_sum or 0.0 for row in launches) / bubble_samples
        if bubble_samples
        else None,
    )
    return last_measured, average
