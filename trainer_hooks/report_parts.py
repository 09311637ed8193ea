"""What the trainer tells the monitor besides its steps, carried by the step reports (``trainer_hooks.monitor``):
the pipeline it is a stage of, the fault-tolerant replica group it is in and each step's quorum, the checkpoints it
saved or skipped, and the step it resumed from."""

from __future__ import annotations

import threading

from opsd.protocol.wire import MAX_CHECKPOINTS_PER_REPORT, CheckpointReport, FtReport, PipelineReport
from trainer_hooks.flight import FlightRecorder


class ReportParts:
    """The parts of ``Monitor``'s reports that the trainer tells it; the monitor's own state they touch is declared
    here and set by the monitor."""

    rank: int
    world_size: int
    batch_shards: int
    coords: dict[str, int]
    steps: int
    internal_errors: int
    flight: FlightRecorder

    def _init_parts(self) -> None:
        self.resumed_from_step: int | None = None
        self._checkpoints: list[CheckpointReport] = []
        self.checkpoints_skipped = 0  # saves skipped: the previous one was still being written
        self._checkpoints_lock = threading.Lock()
        self._pipeline: PipelineReport | None = None  # the schedule, told by ``watch_pipeline``
        self._replica_group: tuple[int, int] | None = None  # (group, groups), told by ``watch_replica_group``
        self._quorum: FtReport | None = None  # the step's, told by ``record_quorum``

    def _error(self, exc: BaseException) -> None:
        raise NotImplementedError

    def watch_pipeline(self, schedule: str, *, stages: int, microbatches: int) -> None:
        """This rank is a stage of a pipeline run by ``schedule`` (``gpipe``, ``1f1b``, ...; what its theory is
        computed for) over ``stages`` stages with ``microbatches`` micro-batches a step: every report says so, with
        the step's bubble."""
        if stages < 1 or microbatches < 1:
            raise ValueError("watch_pipeline: stages and microbatches must be >= 1")
        self._pipeline = PipelineReport(0.0, str(schedule), int(stages), int(microbatches))

    def watch_replica_group(self, group: int, groups: int) -> None:
        """This rank is in replica group ``group`` of ``groups``, each group a world of its own (torchft's
        fault-tolerant replicas): its reports name it by its rank in the whole job (``group`` x the group's world
        size + its rank in the group), count the job's ranks and data-parallel shards, and carry ``group`` as its
        ``dp_replicate`` coordinate. Call once, before the first step."""
        if not 0 <= group < groups:
            raise ValueError(f"watch_replica_group: group {group} must be in [0, {groups})")
        if self._replica_group is not None:
            raise ValueError("watch_replica_group: already told")
        self._replica_group = (int(group), int(groups))
        self.rank += group * self.world_size
        self.world_size *= groups
        self.batch_shards *= groups
        self.coords["dp_replicate"] = int(group)
        self.flight.rank, self.flight.world_size = self.rank, self.world_size

    def record_quorum(
        self,
        *,
        step: int,
        quorum_id: int,
        quorum_replicas: int,
        participants: int,
        committed: bool,
        healing_s: float = 0.0,
        quorum_wait_s: float = 0.0,
    ) -> None:
        """The quorum of the step in progress, sent with its report (``watch_replica_group`` first): the quorum's
        id, the replica groups in it and how many of them trained (a healing group does not), whether the step's
        update was committed, the seconds spent healing from a peer and waiting for the quorum. ``step`` is the
        job's step once this one is done (the steps committed): the report carries it, so that a group that healed
        reports its peers' step and a discarded step is not counted twice. The job's tokens per second (and MFU)
        count the data-parallel shards of the groups that trained."""
        try:
            group, groups = self._replica_group or (0, 1)
            self._quorum = FtReport(
                replica_group=group,
                replica_groups=groups,
                quorum_id=int(quorum_id),
                quorum_replicas=int(quorum_replicas),
                participants=int(participants),
                committed=bool(committed),
                healing_s=max(float(healing_s), 0.0),
                quorum_wait_s=max(float(quorum_wait_s), 0.0),
            )
            self.steps = int(step) - 1  # ``end_step`` counts the step
        except Exception as exc:
            self._error(exc)

    def resume_at(self, step: int) -> None:
        """Training resumed from a checkpoint of ``step``: the next step reported is ``step + 1``, and every report
        of this launch says which checkpoint it resumed from."""
        if step < 0:
            raise ValueError("resume_at: step must be >= 0")
        self.steps = int(step)
        self.resumed_from_step = int(step)

    def record_checkpoint(
        self, step: int, blocking_s: float, total_s: float, nbytes: int, staging_s: float = 0.0
    ) -> None:
        """A checkpoint save of this rank finished: it goes out with the next step report (at most
        ``MAX_CHECKPOINTS_PER_REPORT`` per report, the oldest dropped and counted as internal errors).
        ``staging_s``: the part of ``blocking_s`` spent copying the state to host memory."""
        try:
            entry = CheckpointReport(int(step), float(blocking_s), float(total_s), int(nbytes), float(staging_s))
            with self._checkpoints_lock:  # called from the checkpoint's saving thread
                self._checkpoints.append(entry)
                while len(self._checkpoints) > MAX_CHECKPOINTS_PER_REPORT:
                    self._checkpoints.pop(0)
                    self.internal_errors += 1
        except Exception as exc:
            self._error(exc)

    def record_checkpoint_skipped(self, step: int) -> None:
        """The save of ``step`` was skipped: the previous one was still being written. Every later report counts
        it (``checkpoints_skipped_total``)."""
        self.checkpoints_skipped += 1
