"""A swap that finds no spare, and where a finished run ended, driven step by step on the in-memory backend (no
process, no wall-clock race: the heartbeats and the passes are given their times).

- With no spare left, the run waits, and its ranks are stopped before it does: none of them trains on the failed
  node meanwhile, whatever the machine's speed. The stop is the plan's own (its request id): when a spare comes,
  the recovery goes on without stopping again.
- A finished run's step is where its last launch ended: the newest step it reported, and at least the checkpoint it
  resumed from (a launch that resumes from its last checkpoint has nothing left to do and reports nothing).
"""

from __future__ import annotations

from pathlib import Path

from opsd.backends.fake import FakeBackend
from opsd.controller.config import ControllerConfig
from opsd.controller.controller import Controller
from opsd.controller.rows import RunSpec
from opsd.controller.state import StateStore
from opsd.policy.detection import Failure, FailureKind
from opsd.protocol.heartbeat import Heartbeat, HeartbeatRank
from opsd.protocol.states import NodeRole, RunState
from tests.rows import stored

RUN = "job"
XID = Failure(FailureKind.FATAL_XID, "node-1", None, "XID 79 on GPU 0: fallen off the bus")


def two_nodes(tmp_path: Path, *, checkpoint_step: int | None = None) -> tuple[Controller, FakeBackend]:
    """A run on node-0 and node-1 (a rank each), no spare; its first launch made at t=0."""
    backend = FakeBackend(["node-0", "node-1"], checkpoint_step=checkpoint_step)
    c = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"), ControllerConfig(), backend)
    c.recovery.threaded = False
    c.store.create_run(RUN, RunSpec(backend="fake"), 0.0)
    for node in ("node-0", "node-1"):
        c.store.upsert_node(node, 0.0, run=RUN, role=NodeRole.ACTIVE)
    c.recovery.launch_first(RUN, 0.0)
    return c, backend


def beat(c: Controller, step: int, now_s: float, resumed_from_step: int | None = None) -> None:
    for rank, node in enumerate(("node-0", "node-1")):
        r = HeartbeatRank(
            run=RUN, rank=rank, step=step, step_s=0.1, last_report_unix_s=now_s, resumed_from_step=resumed_from_step
        )
        c.heartbeat(Heartbeat(v=1, node=node, time_unix_s=now_s, ranks=[r]), now_s)


def test_with_no_spare_the_ranks_are_stopped_before_the_run_waits(tmp_path: Path) -> None:
    c, backend = two_nodes(tmp_path)
    beat(c, 22, 1e10)
    run = c.store.run(RUN)
    assert run is not None

    incident = c.open_failure(run, [XID], 1e10)

    run = c.store.run(RUN)
    assert run is not None
    assert run.state == RunState.WAITING_FOR_SPARE
    assert backend.runs[RUN].ranks == {}  # nothing of the run trains on node-1 while it waits
    stops = [e for e in backend.effects if e.step == "stop_ranks"]
    assert [e.request_id for e in stops] == [f"incident-{incident}-2-stop"]  # the plan's own stop, ahead of its turn

    c.set_node_role("node-1", NodeRole.SPARE, "", 1e10 + 5)  # an operator puts it back
    c.tick(1e10 + 5)

    actions = [(a.kind, a.state) for a in c.store.actions(incident_id=incident)]
    assert actions == [("cordon", "done"), ("take_spare", "done"), ("stop", "done"), ("launch", "done")]
    assert [e.step for e in backend.effects].count("stop_ranks") == 1  # not stopped twice
    assert backend.runs[RUN].ranks == {0: "node-0", 1: "node-1"}
    run = c.store.run(RUN)
    assert run is not None
    assert (run.state, run.generation) == (RunState.RUNNING, 2)


def test_a_run_whose_last_launch_resumed_from_its_last_step_ended_there(tmp_path: Path) -> None:
    """Launch 1 reported step 22 and saved step 60 before it was stopped; launch 2 resumes from 60 and exits at
    once, reporting nothing."""
    c, _ = two_nodes(tmp_path, checkpoint_step=60)
    beat(c, 22, 1e10)
    c.tick(1e10)
    run = c.store.run(RUN)
    assert run is not None
    c.open_failure(run, [Failure(FailureKind.PROCESS_EXIT, "node-1", 1, "rank 1 exited with -9")], 1e10 + 1)
    for rank, node in enumerate(("node-0", "node-1")):
        c.rank_exited(RUN, rank, node, 0, 1e10 + 2)

    assert c.final_step(RUN) == 60
    c.store.update_run(RUN, 1e10 + 3, state=RunState.COMPLETED, final_step=c.final_step(RUN))
    status = c.status(RUN, 1e10 + 3)
    assert status is not None
    assert (status.state, status.step) == ("completed", 60)


def test_a_finished_run_ends_at_its_last_launchs_newest_step(tmp_path: Path) -> None:
    c, _ = two_nodes(tmp_path, checkpoint_step=20)
    beat(c, 30, 1e10, resumed_from_step=20)
    beat(c, 41, 1e10 + 1, resumed_from_step=20)
    assert c.final_step(RUN) == 41


def test_a_recovery_takes_its_time_from_the_controllers_clock(tmp_path: Path) -> None:
    """Every time a recovery writes (its steps done, the node cordoned, the relaunch) is the controller's clock's."""
    backend = FakeBackend(["node-0", "node-1", "node-2"])
    c = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"), ControllerConfig(), backend, clock=lambda: 5e9)
    c.recovery.threaded = False
    c.store.create_run(RUN, RunSpec(backend="fake"), 0.0)
    for node in ("node-0", "node-1"):
        c.store.upsert_node(node, 0.0, run=RUN, role=NodeRole.ACTIVE)
    c.store.upsert_node("node-2", 0.0, run=RUN, role=NodeRole.SPARE)
    c.recovery.launch_first(RUN, 0.0)

    incident = c.open_failure(stored(c.store.run(RUN)), [XID], 4e9)

    assert {a.done_s for a in c.store.actions(incident_id=incident)} == {5e9}
    assert {stored(c.store.node(n)).updated_s for n in ("node-1", "node-2")} == {5e9}
    assert stored(c.store.run(RUN)).updated_s == 5e9


def test_a_finished_runs_memory_is_dropped_a_while_after_it_settled(tmp_path: Path) -> None:
    c, _ = two_nodes(tmp_path)
    beat(c, 30, 1e10)
    c.store.update_run(RUN, 1e10, state=RunState.COMPLETED, final_step=30)

    c.tick(1e10 + 1)  # settled: kept for reads a while
    status = c.status(RUN, 1e10 + 1)
    assert status is not None
    assert (RUN in c.memory, status.ranks) == (True, 2)

    c.tick(1e10 + 1 + c.config.forget_finished_s)
    beat(c, 30, 1e10 + 2 + c.config.forget_finished_s)  # an agent still remembers the run's ranks

    assert RUN not in c.memory
    status = c.status(RUN, 1e10 + 3 + c.config.forget_finished_s)
    assert status is not None
    assert (status.state, status.step, status.ranks) == ("completed", 30, 0)


def crash_at_start(c: Controller, now_s: float) -> None:
    """Every rank of the current launch exits 1 before its first step (a bad image, a config error)."""
    for rank, node in enumerate(("node-0", "node-1")):
        c.rank_exited(RUN, rank, node, 1, now_s)
    c.tick(now_s)


def test_a_job_that_fails_at_start_is_failed_not_relaunched_for_ever(tmp_path: Path) -> None:
    """controller.barren_launches (3): the first launch and two relaunches exit before a step; the third failure
    fails the run, its incidents abandoned saying why, and nothing is launched again. A relaunch that steps starts
    the count again. (Times past the wall clock: the executor stamps its launches with it.)"""
    c, backend = two_nodes(tmp_path)
    t = 1e10
    beat(c, 5, t + 1)
    for at in (t + 2, t + 3):  # launch 1 made steps, then failed; launch 2 made none
        crash_at_start(c, at)
    assert stored(c.store.run(RUN)).state == RunState.RUNNING  # 2 failures in a row: relaunched (launch 3)
    beat(c, 7, t + 4, resumed_from_step=5)  # launch 3 steps: the incidents it recovered from close
    c.tick(t + 4)
    assert [i.state for i in c.store.incidents(RUN)] == ["recovered", "recovered"]
    for at in (t + 5, t + 6):
        crash_at_start(c, at)
    assert stored(c.store.run(RUN)).state == RunState.RUNNING  # the count started again
    crash_at_start(c, t + 7)
    run = stored(c.store.run(RUN))
    assert (run.state, run.generation) == (RunState.FAILED, 5)  # launches 3, 4, 5 failed; no launch 6
    assert backend.runs[RUN].generation == 5
    abandoned = [i for i in c.store.incidents(RUN) if i.state == "abandoned"]
    assert len(abandoned) == 3
    assert all("fails at start, and is not launched again" in i.detail for i in abandoned)
