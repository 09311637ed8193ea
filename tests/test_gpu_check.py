"""``python -m bench.gpu_check``, the one command that takes every GPU figure, runs on the CPU with tiny sizes and
prints each of its figures as a ``name=value`` line, with the device and the versions first."""

from __future__ import annotations

import pytest

from bench.gpu_check import FIGURES
from tests.launch import run_module

pytestmark = pytest.mark.slow


def test_gpu_check_prints_every_figure_on_the_cpu() -> None:
    proc = run_module("bench.gpu_check", ["--tiny"], timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line and not line.startswith("#"))
    assert [name for name in ("device", "devices", "python", "torch", "cuda", "nccl") if name not in printed] == []
    assert printed["devices"] == "0"
    missing = [name for part in FIGURES.values() for name in part if name not in printed]
    assert missing == []
    assert not [name for name in printed if name.endswith("_failed")]
    assert printed["collective_timing_source"] == "host"  # gloo: no completion hook
    assert int(printed["flight_recorder_entries_gloo"]) > 0  # the check's own all-gathers, recorded
    assert printed["flops_per_token_measured"] == printed["flops_per_token_formula"]  # docs/mfu.md: they agree
