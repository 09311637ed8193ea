"""A rank that says what it does instead of stepping (a checkpoint it waits for, its end): its agent keeps it until
the rank trains again, and sends it with how long it has lasted; a step report sent late (once its GPU work
completed) for a step that ended before does not end it."""

from __future__ import annotations

import time
from pathlib import Path

from opsd.protocol.wire import VERSION, Activity, ActivityReport, encode
from opsd_agent.daemon import Agent, AgentConfig
from tests.test_agent import samples_of, step
from tests.test_reporter import reporter
from tests.test_wire import report


def said(what: Activity, at_unix_s: float, rank: int = 0) -> ActivityReport:
    return ActivityReport(
        v=VERSION, kind="activity", run="r", rank=rank, host="h", time_unix_s=at_unix_s, activity=what
    )


def activities(tmp_path: Path, *messages: tuple[object, float], now_s: float) -> dict[int, tuple[str, float]]:
    """The heartbeat's ranks' (activity, activity_s) after ``messages`` (each with when the agent took it)."""
    r = reporter(tmp_path, "http://127.0.0.1:9/v1/heartbeat")  # ranks 0 and 1 of run "r", none sent
    for message, at_s in messages:
        if isinstance(message, ActivityReport):
            r.state.ingest_activity(message, at_s)
        else:
            r.state.ingest(step(rank=0, step=50, time_unix_s=message), at_s)
    return {x.rank: (x.activity, round(x.activity_s, 6)) for x in r.heartbeat(now_s).ranks}


def test_an_activity_is_sent_with_how_long_it_lasted_until_the_rank_trains_again(tmp_path: Path) -> None:
    assert activities(tmp_path, (said("checkpoint", 100.0), 100.2), now_s=130.2) == {
        0: ("checkpoint", 30.0),
        1: ("", 0.0),
    }
    trains = (said("checkpoint", 100.0), 100.2), (said("", 140.0), 140.1)
    assert activities(tmp_path, *trains, now_s=150.0)[0] == ("", 0.0)
    a_step_after = (said("checkpoint", 100.0), 100.2), (101.0, 101.1)
    assert activities(tmp_path, *a_step_after, now_s=150.0)[0] == ("", 0.0)


def test_a_step_sent_late_for_a_step_that_ended_before_keeps_it(tmp_path: Path) -> None:
    late = (said("checkpoint", 100.0), 100.2), (99.5, 100.3)  # the step ended at 99.5, its report came at 100.3
    assert activities(tmp_path, *late, now_s=110.2) == {0: ("checkpoint", 10.0), 1: ("", 0.0)}


def test_the_same_activity_said_again_keeps_its_start(tmp_path: Path) -> None:
    again = (said("closing", 100.0), 100.0), (said("closing", 105.0), 105.0)
    assert activities(tmp_path, *again, now_s=120.0)[0] == ("closing", 20.0)


def test_the_agent_exports_what_a_rank_says_it_does_until_it_steps(tmp_path: Path) -> None:
    agent = Agent(AgentConfig(socket=str(tmp_path / "a.sock"), metrics_port=0, node="n1"))
    now = time.time()
    assert agent.handle(encode(report(rank=3, step=9, time_unix_s=now - 1.0))) is None
    assert agent.handle(encode(said("checkpoint", now, rank=3))) is None
    samples = samples_of(agent.metrics_text().decode())
    key = ("opsd_rank_activity_seconds", (("activity", "checkpoint"), ("rank", "3"), ("run", "r")))
    assert 0.0 <= samples[key] < 60.0
    assert agent.handle(encode(report(rank=3, step=10, time_unix_s=now + 1.0))) is None  # it steps again
    assert not [k for k in samples_of(agent.metrics_text().decode()) if k[0] == "opsd_rank_activity_seconds"]
