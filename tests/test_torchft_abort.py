"""The survivors of a replica group that hangs stop waiting on it when opsd names it failed
(``trainer_hooks.integrations.torchft``), on real gloo process groups of torchft's: a peer stopped with its
connections open (as a dead NCCL peer is to its survivors), the survivor's all-reduce abandoned at the policy's word,
and its next quorum's process group built at once (``tests/gloo_abort_job.py``)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from opsd.backends.local.processes import listen_port
from opsd.protocol.policy_file import FailedGroup, Policy, encode_policy
from tests.gloo_abort_job import TIMEOUT_S
from tests.launch import ROOT
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

NAMED_AFTER_S = 1.0  # the policy names group 1 this long after the survivor began to wait


def run_pair(tmp_path: Path, kind: str) -> dict[str, Any]:
    policy, out, port = tmp_path / "policy.json", tmp_path / "out.json", listen_port()
    policy.write_bytes(encode_policy(Policy()))
    job = [sys.executable, "-m", "tests.gloo_abort_job"]
    procs = [subprocess.Popen([*job, str(rank), str(port), str(policy), str(out), kind], cwd=ROOT) for rank in (0, 1)]
    try:
        wait_for("the survivor waiting on its peer", lambda: (tmp_path / "waiting").exists(), 60, alive=procs[0])
        time.sleep(NAMED_AFTER_S)
        named = Policy(failed_groups=(FailedGroup(group=1, incident=7),))
        tmp = policy.with_suffix(".tmp")
        tmp.write_bytes(encode_policy(named))
        tmp.replace(policy)
        named_s = time.time()
        assert procs[0].wait(timeout=60) == 0
        return {**msgspec.json.decode(out.read_bytes()), "named_unix_s": named_s}
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_the_survivor_abandons_the_collective_when_opsd_names_the_group_and_builds_its_next_group_at_once(
    tmp_path: Path,
) -> None:
    result = run_pair(tmp_path, "abortable")
    assert result["completed"] is False
    assert NAMED_AFTER_S <= result["ended_s"] < TIMEOUT_S  # not the collective's timeout: when named
    # within half the timeout of being named (a poll of 0.05 s; the rest is a busy machine's slack)
    assert 0 <= result["ended_unix_s"] - result["named_unix_s"] < TIMEOUT_S / 2
    assert result["errors"] == ["PeerFailedError: replica group 1 failed (opsd)"]  # the step is not committed
    # the set-aside group's operation is not waited for (it would be: about 3 s more, to its timeout)
    assert result["reconfigured_s"] - result["ended_s"] < TIMEOUT_S / 2
    assert result["alone"] == [1.0] * 4  # the new group works


def test_torchfts_own_gloo_group_cannot_abort_a_pending_collective(tmp_path: Path) -> None:
    """Why ``AbortableGloo``: torchft's abort of its gloo group waits for the pending operation, to its timeout."""
    result = run_pair(tmp_path, "torchft")
    assert result["completed"] is False
    assert result["ended_s"] >= TIMEOUT_S - 0.5
    assert result["alone"] == [1.0] * 4
