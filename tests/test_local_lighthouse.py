"""The local backend keeps a fault-tolerant run's Lighthouse: one that dies is started again at its address, the
groups carry on, and a whole-job relaunch after its death finds it (real processes: the Lighthouse, two replica
groups of the reference trainer on torchft, gloo)."""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from opsd.backends.local.backend import LocalBackend, effects
from opsd.backends.local.spec import LocalRunSpec
from opsd.controller.port import Done
from opsd.protocol.ft import ManagerTimeouts
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

STEP_LINE = re.compile(rb"^step (\d+)/", re.MULTILINE)
WAIT_S = 120.0


def newest_step(spec: LocalRunSpec, node: str, generation: int) -> int:
    """The newest step the rank on ``node`` printed in ``generation`` (0: none yet)."""
    log = spec.node_dir(node) / f"rank{spec.node_names().index(node)}.gen{generation}.log"
    found = STEP_LINE.findall(log.read_bytes()) if log.exists() else []
    return max((int(s) for s in found), default=0)


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[LocalBackend]:
    command = (
        *(sys.executable, "-m", "examples.train", "--ft", "--mesh", "dp_replicate=2", "--steps", "100000"),
        *("--dim", "32", "--layers", "2", "--seq-len", "16"),
    )
    spec = LocalRunSpec(
        run="lh",
        command=command,
        nodes=2,
        gpus_per_node=1,
        spares=0,
        workdir=str(tmp_path / "runs"),
        replica_groups=2,
        ft_timeouts=ManagerTimeouts(timeout_s=10, quorum_timeout_s=30, quorum_retries=30),
    )
    b = LocalBackend(spec)
    b.start_agents()
    try:
        yield b
    finally:
        b.close()


def test_a_dead_lighthouse_is_started_again_at_its_address_and_a_whole_job_relaunch_finds_it(
    backend: LocalBackend,
) -> None:
    spec, nodes = backend.spec, backend.spec.node_names()
    address = backend.lighthouse_address
    assert isinstance(backend.relaunch("lh", 1, nodes, "launch-1"), Done)

    def steps(generation: int) -> list[int]:
        backend.supervise()  # what the runner's poll loop does
        return [newest_step(spec, node, generation) for node in nodes]

    def restarts() -> int:
        backend.supervise()
        return backend.lighthouse_restarts

    wait_for("both groups training", lambda: min(steps(1)) >= 3, WAIT_S, interval_s=0.1)
    first = backend.lighthouse
    assert first is not None
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    before = [newest_step(spec, node, 1) for node in nodes]
    wait_for("the Lighthouse started again", lambda: restarts() == 1, 10, interval_s=0.05)
    assert backend.lighthouse is not first
    assert backend.lighthouse_address == address
    wait_for("both groups on after the restart", lambda: min(steps(1)) >= max(before) + 3, WAIT_S, interval_s=0.1)
    (restarted,) = [e for e in effects(spec) if e["step"] == "lighthouse_restarted"]
    assert restarted["exit_code"] == -signal.SIGKILL

    # the Lighthouse dies again, then the whole job: the relaunch's ranks are told the address it is started at
    second = backend.lighthouse
    assert second is not None
    os.kill(second.pid, signal.SIGKILL)
    second.wait()
    backend.kill_ranks()
    assert isinstance(backend.relaunch("lh", 2, nodes, "launch-2"), Done)
    wait_for("the relaunched job training", lambda: min(steps(2)) >= 3, WAIT_S, interval_s=0.1)
    assert restarts() == 2
