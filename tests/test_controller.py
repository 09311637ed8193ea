"""The controller's decisions on heartbeats, driven with a clock of its own (no backend: incidents only)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest

from opsd.backends.fake import FakeBackend
from opsd.controller.config import ControllerConfig
from opsd.controller.controller import Controller
from opsd.controller.rows import RunSpec
from opsd.controller.schedule import SCORING_NICE
from opsd.controller.state import StateStore
from opsd.policy.cadence import CadenceConfig
from opsd.policy.detection import DetectionConfig, Failure
from opsd.policy.stragglers import StragglerConfig
from opsd.protocol.heartbeat import Heartbeat
from opsd.protocol.policy_file import Cadence, Policy

CONFIG = ControllerConfig(
    detection=DetectionConfig(heartbeat_floor_s=3, hang_floor_s=5),
    stragglers=StragglerConfig(window=10, min_samples=5),
    cadence=CadenceConfig(min_interval_s=1, lead_s=2, min_lead_steps=2),
    sample_slot_s=1.0,
)


@pytest.fixture
def controller(tmp_path: Path) -> Controller:
    return Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"), CONFIG)


def beat(
    node: str,
    ranks: list[dict[str, Any]],
    events: list[dict[str, Any]] | None = None,
    timeouts: list[dict[str, Any]] | None = None,
) -> Heartbeat:
    """A heartbeat as the API hands it to the controller: decoded and validated."""
    body = {
        "v": 1,
        "node": node,
        "time_unix_s": 0.0,
        "ranks": ranks,
        "events": events or [],
        "timeouts": timeouts or [],
    }
    return msgspec.convert(body, Heartbeat)


def rank(r: int, step: int, compute_s: float = 0.5, **extra: Any) -> dict[str, Any]:
    return {"run": "job", "rank": r, "step": step, "step_s": 0.6, "compute_s": compute_s, "coords": {}, **extra}


def healthy(c: Controller, until_s: float, slow: dict[int, float] | None = None, start_s: float = 0.0) -> None:
    """Two nodes of two ranks each, a step and a heartbeat every second."""
    t = start_s
    while t < until_s:
        step = int(t) + 1
        for n, ranks in (("n0", (0, 1)), ("n1", (2, 3))):
            c.heartbeat(beat(n, [rank(r, step, 0.5 * (slow or {}).get(r, 1.0)) for r in ranks]), t)
        c.tick(t)
        t += 1.0


def test_a_healthy_run_has_no_incident(controller: Controller) -> None:
    healthy(controller, 30)
    assert controller.store.incidents() == []
    status = controller.status("job", 30)
    assert status is not None
    assert (status.state, status.step, status.ranks, status.stragglers) == ("running", 30, 4, ())


def test_a_runs_launch_and_initialisation_are_startup_badput(tmp_path: Path) -> None:
    """The run starts at 0 s and its ranks' first step is heard at 7 s: 7 s of ``startup``, not productive time; a
    controller started again on the same state store keeps them."""
    url = f"sqlite:///{tmp_path / 'opsd.db'}"
    controller = Controller(StateStore.open(url), CONFIG)
    controller.store.create_run("job", RunSpec(observed=True), 0.0)
    for t in range(7):
        controller.tick(float(t))
    starting = controller.status("job", 5.0)
    assert starting is not None
    assert (starting.ettr, starting.badput_s["startup"]) == (0.0, 5.0)

    healthy(controller, 30, start_s=7.0)

    status = controller.status("job", 30.0)
    assert status is not None
    assert status.badput_s["startup"] == pytest.approx(7.0)
    assert status.ettr == pytest.approx((30.0 - 7.0) / 30.0)
    again = Controller(StateStore.open(url), CONFIG).status("job", 30.0)
    assert again is not None
    assert again.badput_s["startup"] == pytest.approx(7.0)


def test_a_fatal_xid_opens_one_incident_and_is_acknowledged_after(controller: Controller) -> None:
    healthy(controller, 5)
    event = {"seq": 1, "gpu": 1, "xid": 79, "time_s": 5.0, "action": "cordon_and_swap", "reason": "fallen off the bus"}
    reply = controller.heartbeat(beat("n1", [rank(2, 6), rank(3, 6)], [event]), 5.2)
    assert reply.ack_events_up_to == 0  # not handled yet
    failures = controller.tick(5.3)
    assert [(f.kind.value, f.node) for f in failures] == [("fatal_xid", "n1")]
    reply = controller.heartbeat(beat("n1", [rank(2, 6), rank(3, 6)], [event]), 5.5)  # the agent resends it
    assert reply.ack_events_up_to == 1
    controller.tick(5.6)
    (incident,) = controller.store.incidents("job")
    assert (incident.kind, incident.node, incident.state) == ("fatal_xid", "n1", "open")
    assert "XID 79 on GPU 1" in incident.detail


def test_events_needing_no_action_are_acknowledged_at_once(controller: Controller) -> None:
    event = {"seq": 4, "gpu": 0, "xid": 92, "time_s": 1.0, "action": "count", "reason": ""}
    assert controller.heartbeat(beat("n0", [rank(0, 1)], [event]), 1.0).ack_events_up_to == 4


def test_a_silent_node_is_lost_after_5_intervals_or_the_floor(controller: Controller) -> None:
    """n1 dies at 9 s: n0's ranks, its peers, stop at their step of then (the next collective needs n1's ranks)."""
    healthy(controller, 10)
    for t in (10.0, 11.0, 12.0, 13.0, 14.0, 15.0):
        controller.heartbeat(beat("n0", [rank(0, 10), rank(1, 10)]), t)
        failures = controller.tick(t)
        if failures:
            break
    # n1's last heartbeat was at 9 s; 5 x 1 s later it is lost (the swap first; the stalled job's hang comes after)
    assert [(f.kind.value, f.node) for f in failures] == [("heartbeat_loss", "n1"), ("hang", "n0")]
    assert t == 15.0
    (incident,) = controller.store.incidents("job")
    assert incident.failed_s == 9.0  # the last sign of life


def test_a_silent_agent_whose_ranks_peers_step_on_is_a_warning_not_a_failure(controller: Controller) -> None:
    """n1's agent goes quiet at 9 s (a roll, a restart) while the job trains on: n0's ranks keep stepping, which
    they cannot do without n1's ranks. No failure, no recovery: one ``agent_down`` warning, in the status until
    n1 is heard from again."""
    healthy(controller, 10)
    for t in range(10, 25):
        controller.heartbeat(beat("n0", [rank(0, t + 1), rank(1, t + 1)]), float(t))
        assert controller.tick(float(t)) == []
    (incident,) = controller.store.incidents("job")
    assert (incident.kind, incident.node, incident.state) == ("agent_down", "n1", "warned")
    assert "peers stepped" in incident.detail
    status = controller.status("job", 24.0)
    assert status is not None
    assert status.state == "running"
    (down,) = status.agents_down
    assert down.node == "n1"
    assert down.detail.startswith("no heartbeat for 15.0 s")
    assert "peers stepped" in down.detail
    controller.heartbeat(beat("n1", [rank(2, 26), rank(3, 26)]), 25.0)  # back
    controller.heartbeat(beat("n0", [rank(0, 26), rank(1, 26)]), 25.0)
    assert controller.tick(25.0) == []
    status = controller.status("job", 25.0)
    assert status is not None
    assert status.agents_down == ()
    assert [i.kind for i in controller.store.incidents("job")] == ["agent_down"]  # one per silence


@pytest.mark.parametrize(("down", "expected"), [(False, []), (True, ["heartbeat_loss"])], ids=["up", "down"])
def test_a_silent_node_with_no_peer_is_judged_by_the_backend(tmp_path: Path, down: bool, expected: list[str]) -> None:
    """A one-node run: no peer can witness, so the backend's view of the node decides (the fake's ``node_ready``)."""
    backend = FakeBackend(["n0"])
    if down:
        backend.down.add("n0")
    controller = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"), CONFIG, backend)
    for t in range(10):
        controller.heartbeat(beat("n0", [rank(0, t + 1), rank(1, t + 1)]), float(t))
        controller.tick(float(t))
    failures: list[Failure] = []
    for t in range(10, 16):
        failures = failures or controller.tick(float(t))
    assert [f.kind.value for f in failures] == expected
    kinds = [i.kind for i in controller.store.incidents("job")]
    assert kinds == (["heartbeat_loss"] if down else ["agent_down"])


def test_a_hang_is_detected_after_the_floor(controller: Controller) -> None:
    healthy(controller, 9)  # steps 1..9 at 0..8 s
    t = 9.0
    while not (failures := controller.tick(t)):
        for n, ranks in (("n0", (0, 1)), ("n1", (2, 3))):
            # at 9 s ranks 0-2 reach step 10 and wait for rank 3, stuck at step 9; nobody advances after
            controller.heartbeat(beat(n, [rank(r, 9 if r == 3 else 10) for r in ranks]), t)
        t += 0.5
    assert [(f.kind.value, f.rank) for f in failures] == [("hang", 3)]
    assert 9.0 + 5.0 < t <= 9.0 + 5.0 + 1.0  # 5 s floor (3 x 0.6 s steps is less) after the last progress


def test_ranks_that_say_they_wait_for_a_checkpoint_are_not_hung_until_they_train_again(controller: Controller) -> None:
    """Steps 1..9 at 0..8 s, then a synchronous save of 30 s that rank 0 says it waits for (its peers wait for it in
    their next collective): no hang while it says so, against the 5 s floor; once it says it trains again and
    nobody steps, the hang is found after the floor, from then."""
    healthy(controller, 9)
    t = 9.0
    while t < 40.0:  # the save, said by rank 0 at 9 s; heartbeats carry it with how long it has lasted
        for n, ranks in (("n0", (0, 1)), ("n1", (2, 3))):
            said: dict[str, Any] = {"activity": "checkpoint", "activity_s": t - 9.0}
            controller.heartbeat(beat(n, [rank(r, 9, **(said if r == 0 else {})) for r in ranks]), t)
        assert controller.tick(t) == [], t
        t += 0.5
    failures: list[Failure] = []
    while not failures:  # rank 0 trains again (it says so) but nobody steps
        for n, ranks in (("n0", (0, 1)), ("n1", (2, 3))):
            controller.heartbeat(beat(n, [rank(r, 9) for r in ranks]), t)
        failures = controller.tick(t)
        t += 0.5
    assert [f.kind.value for f in failures] == ["hang"]
    assert 40.0 + 5.0 < t <= 40.0 + 5.0 + 1.0, t


def test_a_slow_rank_is_flagged_and_recorded_once(controller: Controller) -> None:
    healthy(controller, 20, slow={2: 1.3})
    status = controller.status("job", 20)
    assert status is not None
    assert [(s.rank, s.node) for s in status.stragglers] == [(2, "n1")]
    assert status.stragglers[0].slowdown_ratio == pytest.approx(1.3)
    (incident,) = controller.store.incidents("job")
    assert (incident.kind, incident.rank, incident.state) == ("straggler", 2, "warned")


def test_collective_timeouts_name_the_rank_that_does_not_wait(controller: Controller) -> None:
    """Ranks 0, 1 and 2 report that they have waited 30 s on an all-reduce; rank 3 reports nothing: the suspect."""
    healthy(controller, 5)
    waits = [
        {"run": "job", "rank": r, "step": 5, "time_unix_s": 5.5, "dim": "dp_shard", "op": "all_reduce", "waited_s": 30}
        for r in (0, 1, 2)
    ]
    controller.heartbeat(beat("n0", [rank(0, 5), rank(1, 5)], timeouts=waits[:2]), 5.5)
    controller.heartbeat(beat("n1", [rank(2, 5), rank(3, 5)], timeouts=waits[2:]), 5.5)
    controller.tick(5.6)
    (incident,) = controller.store.incidents("job")
    assert (incident.kind, incident.node, incident.rank) == ("collective_timeout", "n1", 3)
    assert "rank 0 waited 30 s in all_reduce on dp_shard" in incident.detail


def test_a_timeout_of_a_rank_that_stepped_on_is_no_failure(controller: Controller) -> None:
    healthy(controller, 5)
    late = {"run": "job", "rank": 0, "step": 4, "time_unix_s": 5.5, "dim": "tp", "op": "all_reduce", "waited_s": 30}
    controller.heartbeat(beat("n0", [rank(0, 5), rank(1, 5)], timeouts=[late]), 5.5)
    controller.tick(5.6)
    assert controller.store.incidents("job") == []


def test_stragglers_are_scored_on_the_mean_compute_between_heartbeats(controller: Controller) -> None:
    """Agents send running sums (steps_total, compute_total_s): the controller scores the mean compute of the steps
    between two heartbeats, not the last step alone. Rank 2's last step always looks normal, but the two steps before
    it in each interval took 0.8 s: it is flagged at its mean, (0.8 + 0.8 + 0.5) / 3 / 0.5 = 1.4."""
    totals = {r: (0, 0.0) for r in range(4)}
    for t in range(20):
        for n, ranks in (("n0", (0, 1)), ("n1", (2, 3))):
            entries = []
            for r in ranks:
                steps, seconds = totals[r]
                totals[r] = (steps + 3, seconds + (0.8 + 0.8 + 0.5 if r == 2 else 1.5))
                entries.append(rank(r, 3 * (t + 1), steps_total=totals[r][0], compute_total_s=totals[r][1]))
            controller.heartbeat(beat(n, entries), float(t))
        controller.tick(float(t))
    status = controller.status("job", 20)
    assert status is not None
    assert [s.rank for s in status.stragglers] == [2]
    assert status.stragglers[0].slowdown_ratio == pytest.approx(1.4)


def saves_measured(c: Controller, **sums: float) -> None:
    """Heartbeats at 4 s and 5 s in which every rank reports one save (``sums``: its seconds), each followed by a
    pass."""
    for t in (4.0, 5.0):
        for n, ranks in (("n0", (0, 1)), ("n1", (2, 3))):
            c.heartbeat(beat(n, [rank(r, int(t) + 1, checkpoints=1, **sums) for r in ranks]), t)
        c.tick(t)


def costlier_saves(c: Controller, t: float, step: int, last_rank_step: int | None = None) -> Policy:
    """Heartbeats at ``t`` in which saves cost 100 times as much as in ``saves_measured`` (K moves far), every rank
    at ``step`` but rank 3 at ``last_rank_step`` (default: ``step``), a pass; the policy then told."""
    ckpt = {"checkpoints": 2, "checkpoint_blocking_s": 400.0}
    last = step if last_rank_step is None else last_rank_step
    c.heartbeat(beat("n0", [rank(r, step, **ckpt) for r in (0, 1)]), t)
    c.heartbeat(beat("n1", [rank(2, step, **ckpt), rank(3, last, **ckpt)]), t)
    c.tick(t)
    policy = c.heartbeat(beat("n0", [rank(0, step), rank(1, step)]), t).policy
    assert policy is not None
    return policy


def test_the_cadence_is_published_once_checkpoints_are_measured(controller: Controller) -> None:
    healthy(controller, 3)
    assert controller.heartbeat(beat("n0", [rank(0, 4), rank(1, 4)]), 3.0).policy is None
    saves_measured(controller, checkpoint_blocking_s=2.0)
    policy = controller.heartbeat(beat("n0", [rank(0, 7), rank(1, 7)]), 6.0).policy
    assert policy is not None
    assert policy.checkpoint is not None
    every, start = policy.checkpoint.every_steps, policy.checkpoint.from_step
    assert every > 1
    assert start >= 6 + 2  # ahead of the current step by the lead
    status = controller.status("job", 6.0)
    assert status is not None
    assert status.cadence is not None
    assert "Daly interval" in status.cadence.reason


def test_a_cadence_is_replaced_only_once_every_rank_is_past_its_first_step(controller: Controller) -> None:
    """A published cadence holds from its step E on; before E, the ranks' own. Replaced while a rank has not passed
    E, it would take the rule in force with it for the steps that rank decides now (docs/protocol.md, ``checkpoint``):
    the controller waits until every rank has reported a step past E, then publishes the new one with it as
    ``previous``."""
    healthy(controller, 3)
    saves_measured(controller, checkpoint_blocking_s=2.0)
    first = controller.heartbeat(beat("n0", [rank(0, 7), rank(1, 7)]), 6.0).policy
    assert first is not None
    assert first.checkpoint is not None
    start = first.checkpoint.from_step

    assert costlier_saves(controller, 7.0, start + 50, last_rank_step=start) == first  # rank 3 has not decided E
    replaced = costlier_saves(controller, 8.0, start + 50, last_rank_step=start + 1).checkpoint
    assert replaced is not None
    assert replaced.every_steps != first.checkpoint.every_steps
    assert replaced.from_step > start + 50  # ahead of the newest step by the lead
    assert replaced.previous == Cadence(every_steps=first.checkpoint.every_steps, from_step=start)


def test_a_controller_started_again_replaces_the_cadence_its_predecessor_published(tmp_path: Path) -> None:
    """The cadence published is kept in the store: a controller started again on it (or one that takes over) tells
    the ranks the same policy from its first reply, and replaces it as the one before would have, with it as
    ``previous``. Without it, its first cadence would come without ``previous``, and the steps up to it would fall
    back to the ranks' local cadence while the nodes' files change."""
    url = f"sqlite:///{tmp_path / 'opsd.db'}"
    before = Controller(StateStore.open(url), CONFIG)
    healthy(before, 3)
    saves_measured(before, checkpoint_blocking_s=2.0)
    published = before.heartbeat(beat("n0", [rank(0, 7), rank(1, 7)]), 6.0).policy
    assert published is not None

    again = Controller(StateStore.open(url), CONFIG)
    again.tick(7.0)
    assert again.heartbeat(beat("n0", [rank(0, 8), rank(1, 8)]), 7.0).policy == published
    assert published.checkpoint is not None
    start = published.checkpoint.from_step
    replaced = costlier_saves(again, 8.0, start + 50).checkpoint
    assert replaced is not None
    assert replaced.previous == Cadence(every_steps=published.checkpoint.every_steps, from_step=start)
    assert replaced.from_step > start + 50


def test_the_cadence_is_never_shorter_than_the_measured_write(controller: Controller) -> None:
    """Asynchronous saves blocked 0.1 s but took 3000 s to be written and committed, more than the Daly interval
    (1342 s): a save that often would find the previous one still writing, so the cadence waits for the write."""
    healthy(controller, 3)
    saves_measured(controller, checkpoint_blocking_s=0.1, checkpoint_total_s=3000.0)
    status = controller.status("job", 6.0)
    assert status is not None
    assert status.cadence is not None
    assert status.cadence.every_steps == 5000  # steps of 0.6 s
    assert "no sooner" in status.cadence.reason


@pytest.mark.parametrize(
    ("said", "resumed_from", "lost"),
    [
        pytest.param(20, 20, 15, id="the ranks say which checkpoint they resumed from"),
        pytest.param(None, 36, 0, id="else their first step seen tells"),
    ],
)
def test_a_relaunch_recovers_its_incident_from_the_step_the_ranks_resumed_from(
    controller: Controller, said: int | None, resumed_from: int, lost: int
) -> None:
    """A controller that first hears of the new launch at step 37 (it took over while the ranks ran on)."""
    store = controller.store
    store.create_run("job", RunSpec(observed=True), 0.0)
    store.update_run("job", 0.0, generation=1, last_step=35)
    incident, _ = store.open_incident(
        key="job/gen1", run="job", kind="fatal_xid", node="n1", rank=None, detail="XID 79", failed_s=1.0, detected_s=2.0
    )
    store.update_run("job", 3.0, generation=2)
    extra = {"resumed_from_step": said} if said is not None else {}
    controller.heartbeat(beat("n0", [rank(0, 37, **extra), rank(1, 37, **extra)]), 10.0)

    controller.tick(10.5)

    found = store.incident(incident)
    assert found is not None
    assert (found.state, found.resumed_from_step, found.lost_steps) == ("recovered", resumed_from, lost)


def test_scoring_apart_from_the_detection_passes_flags_the_same_rank(controller: Controller) -> None:
    """``tick_every``'s two threads: the detection passes without the scoring, and the scoring passes."""
    for t in range(20):
        for n, ranks in (("n0", (0, 1)), ("n1", (2, 3))):
            controller.heartbeat(beat(n, [rank(r, t + 1, 0.5 * (1.3 if r == 2 else 1.0)) for r in ranks]), t)
        assert controller.tick(t, score=False) == []
        controller.score(t)
    status = controller.status("job", 20)
    assert status is not None
    assert [s.rank for s in status.stragglers] == [2]
    assert status.stragglers[0].slowdown_ratio == pytest.approx(1.3)


def test_a_long_scoring_pass_holds_no_detection_pass_up(tmp_path: Path) -> None:
    """A slot's scoring of 98,304 ranks takes a second or more (several at its niceness on a busy machine): the
    detection passes go on meanwhile, every interval."""
    c = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"), CONFIG, clock=lambda: 3.0)
    healthy(c, 3)
    scoring, release, five_passes = threading.Event(), threading.Event(), threading.Event()
    passes: list[float] = []
    tick = c.detection.tick

    def long_score(run: str, now_s: float) -> None:
        scoring.set()
        release.wait(60)  # until the passes below are counted (or never: a minute)

    def counted_tick(now_s: float, *, score: bool = True) -> list[Failure]:
        if scoring.is_set() and not release.is_set():
            passes.append(now_s)
            if len(passes) >= 5:
                five_passes.set()
        return tick(now_s, score=score)

    c.scoring._score = long_score  # type: ignore[method-assign]
    c.detection.tick = counted_tick  # type: ignore[method-assign]
    stop = threading.Event()
    thread = threading.Thread(target=c.tick_every, args=(0.02, stop))
    thread.start()
    try:
        assert scoring.wait(30)
        assert five_passes.wait(30)  # five detection passes while the scoring pass has not ended
        assert not release.is_set()
    finally:
        release.set()
        stop.set()
        thread.join(5)


def test_the_scoring_runs_behind_what_answers_agents(controller: Controller) -> None:
    niceness: list[int] = []
    stop = threading.Event()

    def score(now_s: float) -> None:
        stat = Path(f"/proc/self/task/{threading.get_native_id()}/stat").read_text()
        niceness.append(int(stat.rsplit(")", 1)[1].split()[16]))
        stop.set()

    controller.schedule.score = score  # type: ignore[method-assign]
    thread = threading.Thread(target=controller.schedule.score_every, args=(0.01, stop))
    thread.start()
    thread.join(5)
    assert niceness == [max(os.nice(0), SCORING_NICE)]  # the thread alone (a process already nicer keeps its own)
    assert os.nice(0) < SCORING_NICE  # this process, its API's event loop and detection passes, as they were


def test_the_last_reports_heard_after_a_run_completed_raise_its_final_step(controller: Controller) -> None:
    """The backend saw the run complete (a JobSet's Completed condition) before the agents' next heartbeat carried
    the ranks' last steps: the final step is what those say, and the run's end stays when it ended."""
    from opsd.protocol.states import RunState

    healthy(controller, 30)
    ended = controller.final_step("job")
    assert ended == 30
    controller.store.update_run("job", 30.5, state=RunState.COMPLETED, final_step=ended)
    controller.tick(31.0)
    for n, ranks in (("n0", (0, 1)), ("n1", (2, 3))):
        controller.heartbeat(beat(n, [rank(r, 31) for r in ranks]), 32.0)  # the last step, heard late
    controller.tick(33.0)
    status = controller.status("job", 40)
    assert status is not None
    assert (status.state, status.step) == ("completed", 31)
    row = controller.store.run("job")
    assert row is not None
    assert (row.final_step, row.updated_s) == (31, 30.5)
    controller.tick(34.0)  # nothing more to raise
    assert controller.store.run("job").updated_s == 30.5  # type: ignore[union-attr]


def test_the_steps_an_ended_launch_made_are_counted_when_its_reports_come_after_the_stop(
    controller: Controller,
) -> None:
    """A launch stopped at 2 s whose ranks stepped faster than their agents' heartbeats: the controller had heard of
    step 4 only, and the agents' next heartbeats, after the stop, still carry the ranks' last reports (steps 6 and
    7, reported before 2 s). Those are the ended launch's steps, counted in its newest step (a recovery's lost steps
    are counted from it: before, 0 of the 3 steps past a checkpoint of step 4); a report from before the ended launch
    began, or of the new launch, is not."""
    for n, ranks in (("n0", (0, 1)), ("n1", (2, 3))):
        controller.heartbeat(beat(n, [rank(r, 4, last_report_unix_s=1.0) for r in ranks]), 1.0)
    controller.forget_ranks("job", 2.0)  # the stop and the relaunch
    assert controller.ended_step("job") == 4
    controller.heartbeat(beat("n0", [rank(0, 7, last_report_unix_s=1.9), rank(1, 6, last_report_unix_s=1.8)]), 2.5)
    controller.heartbeat(beat("n1", [rank(2, 99, last_report_unix_s=-5.0)]), 2.5)  # a launch before the ended one
    assert controller.ended_step("job") == 7
    controller.heartbeat(beat("n1", [rank(2, 5, last_report_unix_s=3.0, resumed_from_step=4)]), 3.0)  # the new one
    assert controller.ended_step("job") == 7
