"""A rank process's end reported after its replica group was launched again is not the new launch's failure.

Seen in a soak of ``make demo-ft``: a killed rank of group 1's launch 2 was reported ended after the recovery had
stopped the group and while it launched it again; the controller kept that end as the rank's record (of no group, so
no later stop removed it), and every detection pass after found "rank 2 exited with -9" again: the group was
relaunched 165 times in 170 s while group 0 trained on. Here on the in-memory backend (``tests.test_replica_recovery``:
2 replica groups of one rank each), the end of group 1's rank of launch 1 is reported at each point of that race.
"""

from __future__ import annotations

from pathlib import Path

from opsd.controller.controller import Controller
from opsd.policy.detection import Failure, FailureKind
from opsd.protocol.states import IncidentState
from tests.rows import stored
from tests.test_replica_recovery import RUN, T0, beat, ft_run

KILLED = Failure(FailureKind.PROCESS_EXIT, "node-1", 1, "rank 1 exited with -9", signal=True)


def relaunched_group_1(tmp_path: Path) -> tuple[Controller, int]:
    """Both groups at step 40 of launch 1; group 1's rank killed, its incident opened and recovered from: the group
    stopped and launched again (its launch 2, on the spare node-2)."""
    c, _ = ft_run(tmp_path)
    beat(c, T0, {0: 40, 1: 40}, {0: 1, 1: 1})
    incident = c.open_failure(stored(c.store.run(RUN)), [KILLED], T0 + 1)
    assert stored(c.store.run(RUN)).groups[1].launch == 2
    return c, incident


def incidents_of_group_1(c: Controller) -> list[int]:
    return [int(i.id) for i in c.store.incidents(RUN) if i.replica_group == 1]


def test_an_end_of_an_earlier_launch_reported_after_the_relaunch_is_left_out(tmp_path: Path) -> None:
    c, incident = relaunched_group_1(tmp_path)

    c.rank_exited(RUN, 1, "node-1", -9, T0 + 2, launch=1, group=1)  # launch 1's end, heard only now
    for t in (3.0, 4.0, 5.0):
        c.tick(T0 + t)

    assert incidents_of_group_1(c) == [incident]  # no new incident, no second relaunch
    assert stored(c.store.run(RUN)).groups[1].launch == 2


def test_an_end_heard_between_the_stop_and_the_relaunch_goes_with_the_old_launch(tmp_path: Path) -> None:
    """The end arrives while the group is stopped and not yet launched again (its launch still 1): it is kept, as
    the old launch's; the relaunch drops it with the rest of that launch."""
    c, _ = ft_run(tmp_path)
    beat(c, T0, {0: 40, 1: 40}, {0: 1, 1: 1})
    c.forget_group(RUN, 1, T0 + 1)  # the recovery's stop
    c.rank_exited(RUN, 1, "node-1", -9, T0 + 1.5, launch=1, group=1)
    c.group_launched(RUN, 1, 2)  # the recovery's relaunch
    beat(c, T0 + 2, {0: 41}, {0: 1})

    assert c.tick(T0 + 3) == []


def test_an_end_of_the_current_launch_is_its_failure(tmp_path: Path) -> None:
    c, incident = relaunched_group_1(tmp_path)
    beat(c, T0 + 5, {0: 45, 1: 45}, {0: 1, 1: 2})  # group 1 back, at launch 2

    c.rank_exited(RUN, 1, "node-2", -9, T0 + 6, launch=2, group=1)
    c.tick(T0 + 7)

    assert stored(c.store.incident(incident)).state == IncidentState.RECOVERED
    assert len(incidents_of_group_1(c)) == 2  # launch 2's own failure: recovered from in its turn
    assert stored(c.store.run(RUN)).groups[1].launch == 3
