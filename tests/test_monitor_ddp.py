"""DDP's gradient all-reduces, which its reducer issues from C++, are seen once the monitor watches the model."""

from __future__ import annotations

import json

import pytest

from tests.launch import run_module

pytestmark = pytest.mark.slow


def test_ddp_buckets_are_traced_on_dp_replicate() -> None:
    proc = run_module("tests.ddp_job", [], nproc=2, timeout_s=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["replicas_equal"]  # the hook averages exactly as DDP does
    entries = [e for e in result["report"]["comms"] if e[:2] == ["dp_replicate", "all_reduce"]]
    assert {e[5] for e in entries} == {"backward"}  # DDP's buckets are all-reduced as autograd runs
    count, nbytes = sum(e[2] for e in entries), sum(e[3] for e in entries)
    assert count > 1  # 20 kB buckets over ~70 kB of gradients
    assert nbytes == result["param_bytes"]  # every gradient, once
