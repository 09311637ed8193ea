"""Which failures a rank of a fault-tolerant job acts on (``trainer_hooks.integrations.torchft.PeerFailures``): a
replica group the policy names failed, first seen while in a quorum with it, once."""

from __future__ import annotations

import threading
import time

import pytest

from opsd.protocol.policy_file import FailedGroup, Policy
from trainer_hooks.integrations.torchft import PeerFailures


class Source:
    """The policy as the reader hands it (``current`` only); ``broken``: reading it raises."""

    def __init__(self) -> None:
        self.policy = Policy()
        self.broken = False

    def current(self) -> Policy:
        if self.broken:
            raise OSError("unreadable")
        return self.policy

    def name(self, *failed: tuple[int, int]) -> None:
        self.policy = Policy(failed_groups=tuple(FailedGroup(group=g, incident=i) for g, i in failed))


@pytest.fixture
def source() -> Source:
    return Source()


def watcher(source: Source, group: int = 0) -> PeerFailures:
    failures = PeerFailures(source, group, poll_s=3600)  # its thread reads once; the tests call check()
    failures.close()
    return failures


def test_a_group_named_failed_after_the_quorum_formed_is_given_once(source: Source) -> None:
    failures = watcher(source)
    since_s = time.monotonic()
    source.name((1, 7))
    failures.check()
    assert failures.take((0, 1), since_s) == 1
    assert failures.take((0, 1), since_s) is None  # once per incident
    failures.check()
    assert failures.take((0, 1), since_s) is None  # still named: not again


def test_a_failure_seen_before_the_quorum_formed_is_of_a_launch_the_quorum_does_not_hold(source: Source) -> None:
    failures = watcher(source)
    source.name((1, 7))
    failures.check()
    since_s = time.monotonic()  # a later quorum with group 1 in it: its new launch
    assert failures.take((0, 1), since_s) is None
    source.name((1, 7), (1, 9))  # group 1's new launch failed too: another incident
    failures.check()
    assert failures.take((0, 1), since_s) == 1


def test_its_own_group_and_groups_outside_the_quorum_are_not_given(source: Source) -> None:
    failures = watcher(source, group=1)
    since_s = time.monotonic()
    source.name((1, 7), (2, 8))
    failures.check()
    assert failures.take((0, 1), since_s) is None  # 1 is its own, 2 is not in its quorum
    assert failures.take((0, 1, 2), since_s) == 2  # once a quorum holds it (formed before it was seen)


def test_a_waiter_is_woken_by_a_new_failure_and_a_policy_it_cannot_read_is_counted(source: Source) -> None:
    failures = PeerFailures(source, 0, poll_s=0.01)
    try:
        woken = threading.Event()
        failures.wake(woken)
        assert not woken.wait(0.1)
        source.name((1, 7))
        assert woken.wait(5)
        failures.forget(woken)
        source.broken = True
        deadline = time.monotonic() + 5
        while failures.errors == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert failures.errors > 0  # counted, the thread goes on
        source.broken = False
        source.name((1, 7), (1, 8))
        time.sleep(0.1)
        assert failures.take((0, 1), 0.0) == 1
    finally:
        failures.close()
