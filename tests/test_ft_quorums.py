"""The quorum ids the trainer hands torchft's Manager (examples.ft._Quorums): a new quorum always gets a new id,
even when a restarted Lighthouse numbers it as an earlier one; the same quorum gets the same id in every group."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from examples.ft import _Quorums


class Client:
    """torchft's ManagerClient as the Manager uses it: ``_quorum`` answers the Lighthouse's quorum (these calls
    only, with results of the same attributes as torchft's QuorumResult)."""

    def __init__(self, *answers: tuple[int, list[str]]) -> None:
        self.answers = list(answers)

    def _quorum(self, **kwargs: Any) -> SimpleNamespace:
        quorum_id, members = self.answers.pop(0)
        return SimpleNamespace(quorum_id=quorum_id, replica_ids=members, max_step=7, heal=False)

    def should_commit(self, *args: Any) -> bool:
        return True


A, B, B2 = "replica_group_0:aaaa", "replica_group_1:bbbb", "replica_group_1:cccc"


def test_a_quorum_of_other_members_gets_another_id_under_the_same_lighthouse_id() -> None:
    quorums = _Quorums(Client((1, [A, B]), (1, [B]), (1, [B, A]), (2, [A, B2]), (1, [A, B2])))
    ids = [quorums._quorum(step=1).quorum_id for _ in range(5)]
    assert ids[0] != ids[1]  # a restarted Lighthouse's quorum 1 of group 1 alone is not the old quorum 1
    assert ids[2] == ids[0]  # the same members under the same id: the same quorum, whatever their order
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
