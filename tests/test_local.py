"""The local backend's guards (its runs end to end: tests/test_demo.py, test_recoveries.py, test_takeover.py)."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from opsd.backends.local.backend import LocalBackend
from opsd.backends.local.processes import (
    EPHEMERAL_RANGE,
    LOWEST_LISTEN_PORT,
    kill_orphans,
    listen_port,
    running,
    start_time,
)
from opsd.backends.local.spec import LocalRunSpec
from opsd.backends.local.supervise import start_run
from opsd.controller.controller import Controller
from opsd.controller.rows import RunSpec
from opsd.controller.state import StateStore
from opsd.errors import PermanentError
from tests.waiting import wait_for


def test_a_run_name_is_not_taken_twice(tmp_path: Path) -> None:
    controller = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"))
    controller.store.create_run("job", RunSpec(), now_s=1.0)
    controller.store.update_run("job", 2.0, state="completed")
    backend = LocalBackend(LocalRunSpec(run="job", command=("true",), workdir=str(tmp_path / "runs")))
    with pytest.raises(PermanentError, match=r"run 'job' is completed in this state store"):
        start_run(controller, backend, now_s=3.0)
    assert backend.agents == {}  # nothing was started


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"command": ()}, "a trainer command is needed"),
        ({"nodes": 0}, "--nodes and --gpus-per-node must be >= 1"),
        ({"run": "a/b"}, "without '/'"),
    ],
    ids=["no-command", "no-nodes", "slash"],
)
def test_spec_validates_itself(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LocalRunSpec(**{"run": "r", "command": ("true",), **kwargs})  # type: ignore[arg-type]


def test_a_second_controller_of_a_run_is_refused(tmp_path: Path) -> None:
    controller = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"))
    spec = LocalRunSpec(run="job", command=("true",), workdir=str(tmp_path / "runs"))
    controller.store.create_run("job", spec.recorded(), now_s=1.0)  # running: a candidate to take up
    first = LocalBackend(spec)
    first.lock_run()
    try:
        with pytest.raises(PermanentError, match="another opsd run supervising it"):
            start_run(controller, LocalBackend(spec), now_s=2.0)
    finally:
        first.close()
    again = LocalBackend(spec)
    again.lock_run()  # released with the first
    again.close()


def test_what_a_dead_controller_left_is_killed_by_pid_andstart_time(tmp_path: Path) -> None:
    """A recorded process runs with the recorded start time: killed. A pid whose start time differs (reused by
    another process since): left alone."""
    spec = LocalRunSpec(run="job", command=("true",), workdir=str(tmp_path / "runs"))
    left = subprocess.Popen(["sleep", "60"], start_new_session=True)
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        start = start_time(left.pid)
        assert start is not None
        spec.root.mkdir(parents=True)
        record = {"agents": {"node-0": [left.pid, start]}, "ranks": {"0": [other.pid, start - 1]}}
        (spec.root / "processes.json").write_text(json.dumps(record))
        assert kill_orphans(spec) == 1
        assert left.wait(timeout=10) == -signal.SIGKILL
        assert other.poll() is None
    finally:
        for p in (left, other):
            p.kill()
            p.wait()


def test_a_node_is_up_while_its_rank_processes_run_and_are_not_stopped() -> None:
    """The local backend's second witness of a silent node (``processes.running``): a stopped (SIGSTOP) or exited
    process is not running."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert running(proc)
        os.kill(proc.pid, signal.SIGSTOP)
        wait_for("the process stopped", lambda: not running(proc), 10)
        os.kill(proc.pid, signal.SIGCONT)
        wait_for("the process running again", lambda: running(proc), 10)
    finally:
        proc.kill()
        proc.wait()
    assert not running(proc)


def test_a_port_a_process_binds_later_is_below_the_ephemeral_range_and_free() -> None:
    """The rendezvous's and the Lighthouse's ports: the kernel never gives them to an outgoing connection in
    between; one already bound is passed over."""
    low = int(EPHEMERAL_RANGE.read_text().split()[0])
    first = listen_port(rng=random.Random(7))
    assert LOWEST_LISTEN_PORT <= first < low
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", first))
        again = listen_port(rng=random.Random(7))  # the same first choice, now bound: the next one
    assert again != first
    assert LOWEST_LISTEN_PORT <= again < low
