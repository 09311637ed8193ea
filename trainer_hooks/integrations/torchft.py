"""opsd inside a torchft job: the other replica groups stop waiting on a failed one the moment opsd knows.

The survivors of a replica group that hangs (a dead NCCL peer, a GPU fallen off the bus) wait in their cross-group
collective until its timeout (torchft's, 60 s by default): nothing tells them. opsd attributes the failure to the group
within seconds (an XID, a lost node, a hung rank), and from the start of the group's recovery until it is back the
controller names it in the run's policy (``Policy.failed_groups``, docs/protocol.md):

    failures = PeerFailures(PolicyReader(policy_source(), check_every_s=0.1), own_group)
    ...
    work = manager.allreduce(grad)
    if not wait_or_abort(work, manager, pg, failures, quorum_groups, quorum_since_s):
        ...  # abandoned: the Manager has the error, the step will not be committed

``PeerFailures`` reads the policy on a thread of its own; ``wait_or_abort`` waits for the collective or for a group
of its quorum named failed, whichever comes first. Then the step's error is reported to the Manager (the step is not
committed, as after a timeout) and the process group is aborted: NCCL's communicator through torchft's ``abort``
(which interrupts the collective: not run on a GPU here); gloo has no abort that interrupts a pending operation (its
``abort`` waits for it), so an ``AbortableGloo`` sets the group aside, its operation left to time out on gloo's own
thread, and the next quorum builds a new one at once.

A failure counts for a rank only when it first sees it while in a quorum with the group named, formed before it saw
it (``quorum_since_s``): a quorum formed later is without the failed launch (a wedged group cannot join one; a
relaunched group is a new member), and each failure (incident) is acted on once. If a group named failed were in
fact alive and rejoined the same quorum, its survivors would discard their steps (their group set aside) until
opsd's recovery stops it, seconds later.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection
from typing import Any, Protocol

from torchft.process_group import ProcessGroupGloo

from opsd.protocol.policy_file import Policy

log = logging.getLogger(__name__)


class PolicySource(Protocol):
    def current(self) -> Policy: ...


class PeerFailedError(RuntimeError):
    """A replica group of the step's quorum failed, as opsd said: the step's cross-group collective was abandoned."""


class PeerFailures:
    """The replica groups opsd names failed, as this rank first saw them (``Policy.failed_groups``), read by a thread
    of its own every ``poll_s``; each failure is given once (``take``). Never raises."""

    def __init__(self, policy: PolicySource, group: int, *, poll_s: float = 0.1) -> None:
        self.group = group
        self.poll_s = poll_s
        self.errors = 0
        self._policy = policy
        self._lock = threading.Lock()
        self._seen: dict[int, tuple[int, float]] = {}  # incident -> (group, when this rank first saw it)
        self._taken: set[int] = set()
        self._waiters: set[threading.Event] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="opsd-peer-failures", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Read the policy once (the thread does it every ``poll_s``); wake the waiters on a failure not seen before."""
        named = self._policy.current().failed_groups or ()
        fresh = False
        with self._lock:
            for failed in named:
                if failed.incident not in self._seen and failed.group != self.group:
                    self._seen[failed.incident] = (failed.group, time.monotonic())
                    fresh = True
            waiters = list(self._waiters) if fresh else []
        for event in waiters:
            event.set()

    def take(self, groups: Collection[int], since_s: float) -> int | None:
        """A failed group of ``groups`` (a quorum's, formed at ``since_s`` on ``time.monotonic``'s clock) first seen
        after ``since_s`` and not taken before; None when there is none. A failure seen before the quorum formed is
        of a launch the quorum does not hold: dropped."""
        with self._lock:
            for incident, (group, seen_s) in self._seen.items():
                if incident in self._taken or group not in groups:
                    continue
                self._taken.add(incident)
                if seen_s >= since_s:
                    return group
        return None

    def wake(self, event: threading.Event) -> None:
        """Set ``event`` whenever a failure not seen before appears (until ``forget``)."""
        with self._lock:
            self._waiters.add(event)

    def forget(self, event: threading.Event) -> None:
        with self._lock:
            self._waiters.discard(event)

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                self.check()
            except Exception:  # never takes the rank down
                self.errors += 1
                log.exception("reading the failed replica groups failed")
            self._stop.wait(self.poll_s)

    def close(self) -> None:
        self._stop.set()


class AbortableGloo(ProcessGroupGloo):  # type: ignore[misc]
    """torchft's reconfigurable gloo process group, whose abort never waits. gloo cannot interrupt a pending operation:
    its abort waits for it to end, up to its timeout (``tests/test_torchft_abort.py``), and torchft aborts the old
    group at each new quorum: a survivor that abandoned a collective with a failed group would wait in its next
    quorum for as long as it would have in the collective. Here an abort sets the group aside: its operation ends on
    gloo's thread, and the group is let go, on a thread of its own, a while after (its destruction may wait too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._aside: list[tuple[float, Any]] = []

    def abort(self, errored: bool = True) -> None:
        """Set the current group aside (it is not waited for)."""
        now_s = time.monotonic()
        keep_s = 3 * self._timeout.total_seconds()  # its operation has timed out well before
        done = [pg for t, pg in self._aside if now_s - t >= keep_s]
        self._aside = [(t, pg) for t, pg in self._aside if now_s - t < keep_s]
        if done:  # a destruction may wait for a peer's connections: never on the caller's thread
            threading.Thread(target=done.clear, name="opsd-gloo-release", daemon=True).start()
        pg: Any = getattr(self, "_pg", None)
        if pg is not None:
            self._aside.append((now_s, pg))
            self._pg = None


def wait_or_abort(
    work: Any, manager: Any, pg: Any, failures: PeerFailures | None, groups: Collection[int], since_s: float
) -> bool:
    """Wait for ``work`` (a collective ``manager`` started over ``pg``, across the quorum's ``groups``, formed at
    ``since_s``) as ``work.wait()`` does; return at once, False, when one of ``groups`` is named failed meanwhile:
    the Manager is told (``PeerFailedError``: the step will not be committed) and ``pg`` is aborted."""
    inner = getattr(work, "_work", None)  # torchft's managed work around the process group's
    if failures is None or inner is None:
        return bool(work.wait())
    done = threading.Event()
    future = inner.get_future()
    future.add_done_callback(lambda _: done.set())
    failures.wake(done)
    try:
        while not future.done():  # checked after each wake-up is cleared: none is lost
            failed = failures.take(groups, since_s)
            if failed is not None:
                log.warning("replica group %d failed, as opsd says: the step's collective is abandoned", failed)
                manager.report_error(PeerFailedError(f"replica group {failed} failed (opsd)"))
                pg.abort()  # NCCL's communicator aborted; a gloo group set aside (AbortableGloo)
                return False
            done.wait()
            done.clear()
    finally:
        failures.forget(done)
    return bool(work.wait())
