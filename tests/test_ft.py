"""Fault-tolerant replica groups on torchft (docs/ft.md), in real multi-process runs on gloo.

One job of 2 replica groups x 2 ranks (``--mesh dp_replicate=2,dp_shard=2 --ft``, each group a world of its own,
its ranks started as torchrun would by ``examples.ft_launch``) goes through, in order:

1. a start in step: a Lighthouse of ``min_replicas=2`` holds the first quorum until both groups are there, so the
   first steps are those of the plain HSDP job of the same layout, which runs beside it for the comparison;
2. the Lighthouse SIGKILLed and started again on its port (with ``min_replicas=1``): both groups carry on;
3. group 1 SIGKILLed at a random step (seeded; the seed and the step are printed), started again with a fault
   injected that kills it while it heals (the peer's state fetched, not yet loaded), then started again: it heals
   from group 0 and both train to the end, group 0 never waiting long;
4. a whole-job restart from the checkpoint group 0 wrote (every group loads it), with a Lighthouse of
   ``min_replicas=2``: group 1 SIGKILLed, group 0 finds no quorum and exits 75 without training alone.

The steps' timing comes from the ranks' own step reports (``--opsd-monitor --opsd-jsonl``, each line decoded
against the wire format); the run's end is written by the test (``--steps-file``), so no check depends on how fast
the machine is.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from examples.ft_launch import (
    Lighthouse,
    ReplicaGroup,
    longest_gap,
    start_group,
    start_lighthouse,
    step_reports,
)
from opsd.protocol.ft import EXIT_NO_QUORUM, LighthouseConfig, ManagerTimeouts, ReplicaGroupEnv
from opsd.protocol.wire import StepReport
from tests.launch import run_module
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

SEED = int(os.environ.get("OPSD_FT_TEST_SEED", "2027"))
MESH = "dp_replicate=2,dp_shard=2"
MODEL = ("--dim", "32", "--layers", "2", "--seq-len", "16")
PARITY_STEPS = 8
HEARTBEAT_TIMEOUT_MS = 2000
QUORUM_TIMEOUT_S = 20  # the survivors' bound: beyond it a group gives up (exit 75)
WAIT_S = 180.0  # how long the test waits for anything before it fails: a hang, not a slow machine
# a float32 sum of 4 positive losses in another order: at most 3 roundings of 2^-24 apart
LOSS_RTOL = 3 * 2.0**-24


@dataclass
class Job:
    """The fault-tolerant job under test: its Lighthouse, its groups, their files, and the times of what the test
    did to them (unix seconds)."""

    root: Path
    lighthouse: Lighthouse
    timeouts: ManagerTimeouts
    groups: dict[int, ReplicaGroup] = field(default_factory=dict)
    events: dict[str, float] = field(default_factory=dict)
    starts: int = 0
    model: tuple[str, ...] = MODEL

    def start(self, group: int, *extra: str, heal_from_peer: bool = False) -> ReplicaGroup:
        self.starts += 1
        replica = ReplicaGroupEnv(group, 2, self.lighthouse.address, 1, self.timeouts, heal_from_peer=heal_from_peer)
        argv = [
            *("--mesh", MESH, "--steps", "100000", "--steps-file", str(self.root / "last-step"), *self.model),
            *("--opsd-monitor", "--opsd-jsonl", str(self.root / "rank{rank}.jsonl"), "--state-digests"),
            *("--losses-out", str(self.root / "group{replica_group}.json"), "--ckpt-dir", str(self.root / "ckpt")),
            *("--ckpt-every", "100", "--ckpt-sync", *extra),
        ]
        log = (self.root / f"group{group}.start{self.starts}.log").open("wb")
        self.groups[group] = start_group(replica, 2, argv, log=log)
        return self.groups[group]

    def last_s(self, group: int) -> float | None:
        """When the group's rank 0 last reported a step."""
        last = self.last(group)
        return last.time_unix_s if last is not None else None

    def last(self, group: int) -> StepReport | None:
        """The last report of the group's rank 0."""
        found = step_reports(self.root / f"rank{2 * group}.jsonl")
        return found[-1] if found else None

    def step(self, group: int) -> int:
        report = self.last(group)
        return report.step if report is not None else 0

    def wait(self, what: str, done: Callable[[], bool]) -> None:
        """Until ``done()``; a group that fails meanwhile fails the wait at once."""

        def statuses() -> str:
            return f"exit statuses {[(g, job.poll()) for g, job in self.groups.items()]} ({self.root})"

        def none_failed() -> bool:
            return all(job.poll() in (None, 0) for job in self.groups.values())

        wait_for(what, done, WAIT_S, alive=none_failed, context=statuses, interval_s=0.02)

    def in_quorum_of_two_since(self, group: int, since: float) -> bool:
        report = self.last(group)
        ft = report.ft if report is not None else None
        return report is not None and report.time_unix_s > since and ft is not None and ft.quorum_replicas == 2

    def close(self) -> None:
        for job in self.groups.values():
            job.kill()
        self.lighthouse.kill()


@contextlib.contextmanager
def job(root: Path, config: LighthouseConfig, timeouts: ManagerTimeouts) -> Iterator[Job]:
    root.mkdir(parents=True, exist_ok=True)
    the_job = Job(root, start_lighthouse(config, log=(root / "lighthouse.log").open("ab")), timeouts)
    try:
        yield the_job
    finally:
        the_job.close()


def steps_of(root: Path, rank: int) -> list[StepReport]:
    return step_reports(root / f"rank{rank}.jsonl")


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The plain HSDP job of the same layout, one torchrun of 4 ranks."""
    out = tmp_path_factory.mktemp("plain") / "report.json"
    argv = ["--mesh", MESH, "--steps", str(PARITY_STEPS), *MODEL, "--state-digests", "--losses-out", str(out)]
    proc = run_module("examples.train", argv, nproc=4)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report: dict[str, Any] = json.loads(out.read_text())
    return report


@pytest.fixture(scope="module")
def failures(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    """Steps 1-3 of the module's docstring; the job once both groups have finished."""
    rng = random.Random(SEED)
    timeouts = ManagerTimeouts(timeout_s=30, quorum_timeout_s=QUORUM_TIMEOUT_S, quorum_retries=QUORUM_TIMEOUT_S)
    in_step = LighthouseConfig(min_replicas=2, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    with job(tmp_path_factory.mktemp("ft"), in_step, timeouts) as j:
        j.start(0)
        j.start(1)
        j.wait("both groups past the parity steps", lambda: min(j.step(0), j.step(1)) > PARITY_STEPS)
        j.events["lighthouse_killed"] = time.time()
        j.lighthouse.kill()
        j.lighthouse = start_lighthouse(
            LighthouseConfig(min_replicas=1, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS),
            j.lighthouse.port,
            log=(j.root / "lighthouse.log").open("ab"),
        )
        j.events["lighthouse_started"] = time.time()
        after = max(j.step(0), j.step(1)) + 3
        j.wait("both groups on after the Lighthouse's restart", lambda: min(j.step(0), j.step(1)) >= after)

        kill_at = j.step(1) + rng.randint(2, 12)
        print(f"seed {SEED}: group 1 is killed at step {kill_at}")
        j.wait(f"group 1 at step {kill_at}", lambda: j.step(1) >= kill_at)
        j.events["killed"] = time.time()  # before the kill: group 0's step in flight fails as soon as it is done
        j.groups[1].kill()
        j.events["killed_at_step"] = j.step(1)
        j.events["restarted_1"] = time.time()
        healing = j.start(1, "--ft-kill-while-healing")
        assert healing.wait(WAIT_S) != 0
        j.events["died_healing"] = time.time()
        j.events["restarted_2"] = time.time()
        j.start(1)
        j.wait("group 1 healed", lambda: j.in_quorum_of_two_since(1, j.events["restarted_2"]))
        j.events["healed"] = time.time()
        last = max(j.step(0), j.step(1)) + 5
        (j.root / "last-step").write_text(str(last))
        for g in (0, 1):
            assert j.groups[g].wait(WAIT_S) == 0, f"group {g}: see {j.root}"
        j.events["last_step"] = last
        yield j


def test_the_first_steps_are_those_of_plain_hsdp(plain: dict[str, Any], failures: Job) -> None:
    report = json.loads((failures.root / "group0.json").read_text())  # group 1's last launch started later
    for step in range(1, PARITY_STEPS + 1):
        # ranks 0, 1 of group 0 hold what ranks 0, 1 (and 2, 3: replicas) of the plain job hold: bitwise the same
        # model and optimizer state, which the gradients of both groups made
        expected = plain["step_digests"][str(step)]
        assert expected[:2] == expected[2:]
        assert report["step_digests"][str(step)] == expected[:2], f"step {step}"
    # the mean loss: the ranks' losses summed in the group, then over the groups (plain: over the 4 at once)
    assert report["losses"][:PARITY_STEPS] == pytest.approx(plain["losses"], rel=LOSS_RTOL)


def test_the_groups_carry_on_through_a_lighthouse_restart(failures: Job) -> None:
    killed, started = failures.events["lighthouse_killed"], failures.events["lighthouse_started"]
    for rank in (0, 2):
        steps = steps_of(failures.root, rank)
        # the new Lighthouse may serve a quorum before start_lighthouse returns: steps after the kill count
        after = [r for r in steps if r.time_unix_s > killed and r.ft is not None and r.ft.committed]
        assert any(r.time_unix_s > started for r in after), f"rank {rank} committed no step after the restart"
        before = [r for r in steps if r.time_unix_s < killed][-1]
        assert after[0].step <= before.step + 2  # it went on from where it was
        gap = longest_gap(steps, killed, started)
        print(f"rank {rank}: longest wait around the Lighthouse's restart {gap:.2f} s")
        assert gap < QUORUM_TIMEOUT_S


def test_a_killed_group_leaves_its_peer_stepping_and_heals_from_it(failures: Job) -> None:
    e = failures.events
    survivor = steps_of(failures.root, 0)
    gap = longest_gap(survivor, e["killed"], e["healed"])
    print(f"group 0: longest wait between two steps while group 1 was down: {gap:.2f} s")
    assert gap < HEARTBEAT_TIMEOUT_MS / 1000 + 5.0  # the Lighthouse drops the dead group after its heartbeat timeout
    assert gap < QUORUM_TIMEOUT_S
    alone = [r for r in survivor if r.time_unix_s > e["killed"] and r.ft is not None and r.ft.quorum_replicas == 1]
    assert len(alone) > 1
    assert all(r.ft is not None and r.ft.committed for r in alone)
    healed = [r for r in steps_of(failures.root, 2) if r.time_unix_s > e["restarted_2"]]
    first = healed[0]
    missed = first.step - 1 - int(e["killed_at_step"])
    assert first.ft is not None
    assert first.ft.healing_s > 0
    assert first.ft.participants == 1
    heal_s = first.time_unix_s - e["restarted_2"]
    print(f"group 1 missed {missed} steps; healed {heal_s:.1f} s after its start ({first.ft.healing_s:.3f} s fetching)")
    report = json.loads((failures.root / "group1.json").read_text())
    peer = json.loads((failures.root / "group0.json").read_text())
    assert report["heals"] == 1  # group 0 may have healed once too: after the Lighthouse's restart (docs/ft.md)
    # its weights and optimizer state equal its peer's right after healing, and at every step after
    assert report["step_digests"][str(first.step)] == peer["step_digests"][str(first.step)]
    assert report["state_hashes"] == peer["state_hashes"]


def test_a_group_killed_while_healing_is_restarted_and_heals(failures: Job) -> None:
    e = failures.events
    logs = sorted(failures.root.glob("group1.start*.log"))
    assert any(b"killed while healing" in log.read_bytes() for log in logs)
    survivor = steps_of(failures.root, 0)
    gap = longest_gap(survivor, e["restarted_1"], e["died_healing"])
    print(f"group 0: longest wait around group 1's death while healing: {gap:.2f} s")
    assert gap < HEARTBEAT_TIMEOUT_MS / 1000 + 5.0
    assert max(r.step for r in survivor) == e["last_step"]


def test_without_enough_groups_a_survivor_exits_75_after_a_whole_job_restart(
    failures: Job, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Both groups restart from the checkpoint group 0 wrote (here as groups of one rank: the checkpoint is
    resharded), and a Lighthouse of ``min_replicas=2`` leaves the survivor of a failure without a quorum."""
    timeouts = ManagerTimeouts(timeout_s=10, quorum_timeout_s=3)
    with job(tmp_path_factory.mktemp("resume"), LighthouseConfig(min_replicas=2), timeouts) as j:
        resumed_from = int(failures.events["last_step"])
        for g in (0, 1):
            replica = ReplicaGroupEnv(g, 2, j.lighthouse.address, 2, timeouts)
            argv = [
                *("--mesh", "dp_replicate=2", "--steps", "100000", *MODEL, "--opsd-monitor"),
                *("--opsd-jsonl", str(j.root / "rank{rank}.jsonl"), "--ckpt-dir", str(failures.root / "ckpt")),
                "--resume",
            ]
            j.groups[g] = start_group(replica, 1, argv, log=(j.root / f"group{g}.log").open("wb"))
        step = lambda g: steps_of(j.root, g)[-1].step if steps_of(j.root, g) else 0  # noqa: E731
        j.wait("both groups resumed", lambda: min(step(0), step(1)) >= resumed_from + 3)
        killed = time.time()
        j.groups[1].kill()
        assert j.groups[0].wait(WAIT_S) == EXIT_NO_QUORUM
        gave_up_s = time.time() - killed
        assert "no quorum within 3 s" in (j.root / "group0.log").read_text()
        steps = steps_of(j.root, 0)
        assert steps[0].resumed_from_step == resumed_from
        assert steps[0].step == resumed_from + 1
        alone = [r for r in steps if r.time_unix_s > killed and r.ft is not None and r.ft.committed]
        assert all(r.ft is not None and r.ft.quorum_replicas == 2 for r in alone)  # never a step alone
        print(f"group 0 gave up {gave_up_s:.1f} s after group 1 died (quorum timeout 3 s)")


# a model whose state per rank (~25 MB: weights and Adam's two moments, sharded over 2 ranks) is well beyond what the
# sockets between two ranks buffer: a healer that reads slowly holds the serving rank's request for the whole read
SLOW_HEAL_MODEL = ("--dim", "512", "--layers", "4", "--seq-len", "16")
SLOW_HEAL_BYTES_PER_S = 2_000_000
SLOW_HEAL_TIMEOUT_S = 3


@contextlib.contextmanager
def slow_heal_job(tmp_path: Path) -> Iterator[tuple[Job, float]]:
    """Both groups of ``SLOW_HEAL_MODEL`` at step 3 under the Manager's timeouts of 3 s, then group 1 killed: the job,
    and when group 1 was killed."""
    timeouts = ManagerTimeouts(
        timeout_s=SLOW_HEAL_TIMEOUT_S,
        quorum_timeout_s=QUORUM_TIMEOUT_S,
        connect_timeout_s=SLOW_HEAL_TIMEOUT_S,
        quorum_retries=20,
    )
    config = LighthouseConfig(min_replicas=1, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    with job(tmp_path, config, timeouts) as j:
        j.model = SLOW_HEAL_MODEL
        j.start(0)
        j.start(1)
        j.wait("both groups at step 3", lambda: min(j.step(0), j.step(1)) >= 3)
        j.groups[1].kill()
        yield j, time.time()


def test_a_healer_that_reads_slowly_neither_crashes_its_peer_nor_stalls_it_beyond_the_bound(tmp_path: Path) -> None:
    """Group 1 is killed and started again reading group 0's state at 2 MB/s, for longer than twice the Manager's
    timeout. Before: group 0's collective with the healer timed out, its step was discarded, and ``should_commit``
    waited for the request still being served, then raised ``TimeoutError`` into the training loop: the healthy
    group died. Now the serving group never waits for a request (it serves a snapshot), and its longest gap between
    committed steps is bounded by the heal's transfer plus two timeouts."""
    with slow_heal_job(tmp_path) as (j, killed):
        j.start(1, "--ft-heal-read-bytes-per-s", str(SLOW_HEAL_BYTES_PER_S), "--ft-heal-min-mb-per-s", "1")
        j.wait("group 1 healed", lambda: j.in_quorum_of_two_since(1, killed))
        last = max(j.step(0), j.step(1)) + 3
        (j.root / "last-step").write_text(str(last))
        for g in (0, 1):
            assert j.groups[g].wait(WAIT_S) == 0, f"group {g}: see {j.root}"
        healed = [r for r in steps_of(j.root, 2) if r.time_unix_s > killed and r.ft is not None and r.ft.healing_s]
        assert healed, f"group 1 never healed: see {j.root}"
        fetch_s = max(r.ft.healing_s for r in healed if r.ft is not None)
        stall_s = longest_gap(steps_of(j.root, 0), killed, healed[0].time_unix_s)
        print(f"group 1 read its peer's state in {fetch_s:.1f} s; group 0's longest gap {stall_s:.1f} s")
        assert fetch_s > 2 * SLOW_HEAL_TIMEOUT_S  # the read outlasted the timeouts that crashed group 0 before
        assert stall_s < fetch_s + 2 * SLOW_HEAL_TIMEOUT_S + HEARTBEAT_TIMEOUT_MS / 1000
        assert max(r.step for r in steps_of(j.root, 0)) == last


def test_a_healer_slower_than_its_deadline_gives_up_and_ends_and_its_peer_trains_on(tmp_path: Path) -> None:
    """The same slow healer, whose deadline is its state's size at 4 MB/s (about 6 s; it would read for 12): it gives
    up at its deadline and its group ends (exit 1: opsd would relaunch it), rather than try again at each quorum and
    hold group 0 that long every time. Group 0's longest gap is bounded by the deadline, not by the read, and it trains
    on alone."""
    with slow_heal_job(tmp_path) as (j, killed):
        healer = j.start(1, "--ft-heal-read-bytes-per-s", str(SLOW_HEAL_BYTES_PER_S), "--ft-heal-min-mb-per-s", "4")
        assert healer.wait(WAIT_S) == 1, f"group 1: see {j.root}"
        ended = time.time()
        log = "".join(f.read_text() for f in j.root.glob("group1.start*.log"))
        assert "gives up healing: the peer's state not read within" in log
        alive = j.groups[0]
        wait_for(
            "group 0 training on alone", lambda: (j.last_s(0) or 0) > ended, WAIT_S, alive=lambda: alive.poll() is None
        )
        last = j.step(0) + 3
        (j.root / "last-step").write_text(str(last))
        assert j.groups[0].wait(WAIT_S) == 0, f"group 0: see {j.root}"
        limit_s = float(re.search(r"not read within ([\d.]+) s", log).group(1))  # type: ignore[union-attr]
        stall_s = longest_gap(steps_of(j.root, 0), killed, ended)
        print(
            f"group 1 gave up after {limit_s:.1f} s, {ended - killed:.1f} s after the kill; group 0's gap {stall_s} s"
        )
        read_s = 25_000_000 / SLOW_HEAL_BYTES_PER_S
        assert SLOW_HEAL_TIMEOUT_S < limit_s < read_s  # sized to the state, short of the whole read
        assert stall_s is not None
        assert stall_s < limit_s + 2 * SLOW_HEAL_TIMEOUT_S + HEARTBEAT_TIMEOUT_MS / 1000
        assert max(r.step for r in steps_of(j.root, 0)) == last


def test_a_group_relaunched_to_heal_that_finds_no_peer_exits_75_without_training_from_scratch(tmp_path: Path) -> None:
    """A group relaunched alone (``OPSD_FT_HEAL_FROM_PEER=1``) reads no checkpoint. Its peer is gone too (here: never
    started): rather than train the job again from its initial weights, it discards each step it would take alone
    and exits 75 after the quorum timeout, which leaves the controller a whole-job restart from the checkpoint."""
    timeouts = ManagerTimeouts(timeout_s=10, quorum_timeout_s=3, quorum_retries=3)
    with job(tmp_path, LighthouseConfig(min_replicas=1, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS), timeouts) as j:
        started = time.time()
        alone = j.start(1, "--resume", heal_from_peer=True)
        assert alone.wait(WAIT_S) == EXIT_NO_QUORUM, f"see {j.root}"
        gave_up_s = time.time() - started
        log = next(j.root.glob("group1.start*.log")).read_text(errors="replace")
        assert "no live peer to heal from within 3 s" in log
        assert "no checkpoint read" in log
        reports = [r.ft for r in steps_of(j.root, 2) if r.ft is not None]  # the step that raised has no quorum
        assert reports, f"group 1 reported no step: see {j.root}"
        assert not any(ft.committed for ft in reports)  # every step it took alone discarded
        print(f"group 1 discarded {len(reports)} steps alone and gave up {gave_up_s:.1f} s after its start")


@pytest.mark.parametrize(("host", "url"), [("10.1.2.3", "http://10.1.2.3:"), ("[fd00::12]", "http://[fd00::12]:")])
def test_a_groups_state_server_says_the_address_it_is_reached_at(host: str, url: str) -> None:
    """What the Manager hands a healer (``metadata``): the advertised address (a pod's IP), not the host name."""
    from examples.ft_transport import PeerTransport

    transport = PeerTransport(timedelta(seconds=5), host)
    try:
        assert transport.metadata().startswith(url)
        assert transport.metadata().endswith("/checkpoint/")
    finally:
        transport.shutdown()
