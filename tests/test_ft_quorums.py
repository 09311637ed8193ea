"""The quorum ids the trainer hands torchft's Manager (examples.ft._Quorums): a new quorum always gets a new id,
even when a restarted Lighthouse numbers it as an earlier one, with the same members or others; the same quorum gets
the same id in every group."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from examples.ft import _Quorums


class Client:
    """torchft's ManagerClient as the Manager uses it: ``_quorum`` answers the Lighthouse's quorum (these calls
    only, with results of the same attributes as torchft's QuorumResult): (Lighthouse id, members, max_step)."""

    def __init__(self, *answers: tuple[int, list[str]] | tuple[int, list[str], int]) -> None:
        self.answers = list(answers)

    def _quorum(self, **kwargs: Any) -> SimpleNamespace:
        quorum_id, members, *step = self.answers.pop(0)
        return SimpleNamespace(quorum_id=quorum_id, replica_ids=members, max_step=step[0] if step else 7, heal=False)

    def should_commit(self, *args: Any) -> bool:
        return True


A, B, B2 = "replica_group_0:aaaa", "replica_group_1:bbbb", "replica_group_1:cccc"


def test_a_quorum_of_other_members_gets_another_id_under_the_same_lighthouse_id() -> None:
    quorums = _Quorums(Client((1, [A, B]), (1, [B, A], 8), (1, [B]), (2, [A, B2]), (1, [A, B2])))
    ids = [quorums._quorum(step=1).quorum_id for _ in range(5)]
    assert ids[1] == ids[0]  # the same members under the same id, a step on: the same quorum, whatever their order
    assert ids[2] != ids[0]  # a restarted Lighthouse's quorum 1 of group 1 alone is not the old quorum 1
    assert ids[3] != ids[4]  # group 1 restarted: another member under its group's name
    assert len(set(ids)) == 4
    assert all(0 <= i < 2**56 for i in ids)
    assert (quorums.quorum_id, quorums.groups) == (1, (0, 1))  # the Lighthouse's id, the groups in it


def test_every_group_of_a_quorum_gets_the_same_id_and_the_rest_passes_through() -> None:
    mine, theirs = _Quorums(Client((4, [A, B]))), _Quorums(Client((4, [B, A])))
    result = mine._quorum(step=3)
    assert result.quorum_id == theirs._quorum(step=3).quorum_id
    assert (result.max_step, result.heal, result.replica_ids) == (7, False, [A, B])
    assert mine.should_commit(0, 3, True) is True


def test_the_same_members_under_the_same_id_after_a_lighthouse_restart_are_a_new_quorum_in_both_groups() -> None:
    """The soak's case: both groups in the Lighthouse's quorum 2 to step 30; the Lighthouse restarts; group 0 trains
    alone in the new one's quorum 1 to step 86; group 1, healing, joins, and the new Lighthouse's quorum 2 has the same
    members as the old one's. Group 0 saw another quorum meanwhile, group 1 a jump of its step: both take it as a new
    quorum, under the same id, which is not the old quorum 2's (whose keys the store still holds)."""
    before = [(2, [A, B], step) for step in range(27, 31)]
    group0 = _Quorums(Client(*before, *[(1, [A], step) for step in range(30, 87)], (2, [A, B], 86), (2, [A, B], 87)))
    group1 = _Quorums(Client(*before, (2, [A, B], 86), (2, [A, B], 87)))
    ids0 = [group0._quorum().quorum_id for _ in range(4 + 57 + 2)]
    ids1 = [group1._quorum().quorum_id for _ in range(4 + 2)]
    assert ids0[:4] == ids1[:4] == [ids0[0]] * 4  # one quorum while the steps go on
    assert ids0[-2:] == ids1[-2:] == [ids0[-1]] * 2  # the new quorum 2: one id in both groups, kept a step on
    assert ids0[-1] != ids0[0]  # and not the old quorum 2's
    assert len({*ids0[4:61]}) == 1  # group 0 alone: one quorum
