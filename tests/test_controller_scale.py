"""``bench.controller_scale`` on a small load (32 nodes x 8 GPUs): the real ``opsd serve`` takes heartbeats and
liveness datagrams, finds the node that went silent, and the benchmark's figures are printed last, as
``name=value``."""

from __future__ import annotations

import math
import re

import pytest

from bench.controller_scale import main

pytestmark = pytest.mark.slow


def test_a_small_load_finds_the_silent_node(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--nodes", "32", "--gpus-per-node", "8", "--warmup-s", "2", "--duration-s", "7"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].startswith("ingest_p99_ms=")
    assert lines[-1].startswith("silent_node_detect_s=")
    figures = {k: float(v) for k, v in (line.split("=", 1) for line in lines if re.fullmatch(r"\w+=\S+", line))}
    assert "silent node node-00016: no heartbeat for" in "\n".join(lines)
    assert 3.0 < figures["silent_node_detect_s"] < 10.0  # 5 x the 1 s interval, a pass and a poll after
    assert 0 < figures["ingest_p99_ms"] < 1000.0
    assert 25 <= figures["heartbeats_per_s"] <= 32  # 31 nodes heartbeat, one a second each
    assert 25 <= figures["datagrams_per_s"] <= 32  # and say they are alive by datagram, once a second each
    assert 0 < figures["datagram_p99_ms"] <= figures["ingest_p99_ms"]
    assert math.isfinite(figures["controller_cpu_ratio"])
