"""``bench.goodput`` and what it stands on: the measured costs file, the model that scales it to 16,384 GPUs, and
the parsing of ``bench.checkpoint_stall``'s output (on a real, small run)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from bench import goodput, measured_costs
from bench.measured_costs import Measured, parse_checkpoint_stall
from bench.scale_model import Job, scale
from tests.launch import run_module

HERE = Measured(
    checkpoint_bytes=800e6,
    checkpoint_ranks=4,
    async_blocking_s=0.5,
    async_staging_s=0.3,
    sync_blocking_s=2.0,
    xid_detection_s=0.6,
    controller_steps_s=0.8,
    rank_startup_s=40.0,
    source="test",
)


def test_each_part_grows_with_what_the_model_says() -> None:
    job = Job(gpus=16384, slowest_rank_bytes=4e9, storage_bytes_per_s=2e12, communicator_init_s=30.0)
    scaled = scale(HERE, job)
    # staging: 4 GB against 200 MB a rank here (x20); the rest: log2(16384) / log2(4) = x7
    assert scaled.costs.checkpoint_blocking_s == pytest.approx(0.3 * 20 + 0.2 * 7)
    # 200 MB written in 2 s a rank here: 100 MB/s, 40 s for 4 GB; the storage would take 4.86 TB / 2 TB/s = 2.4 s
    assert scaled.costs.checkpoint_background_s == pytest.approx(40.0)
    assert scaled.costs.restart_s == pytest.approx(0.8 + 40.0 + 30.0 + 40.0)  # steps, start-up, set-up, restore
    # the demo's agents sample GPUs every 0.2 s, a production agent every 5 s: 0.6 - 0.1 + 2.5
    assert scaled.detection.xid_s == pytest.approx(3.0)
    assert (scaled.detection.node_lost_s, scaled.detection.hang_s) == (10.0, 60.0)  # the DetectionConfig defaults

    slow_storage = scale(HERE, dataclasses.replace(job, storage_bytes_per_s=1e10))
    assert slow_storage.costs.checkpoint_background_s == pytest.approx(405e9 * 12 / 1e10)  # the storage's limit
    twice = scale(HERE, dataclasses.replace(job, slowest_rank_bytes=8e9))
    assert twice.costs.checkpoint_blocking_s - scaled.costs.checkpoint_blocking_s == pytest.approx(0.3 * 20)
    no_setup = scale(HERE, dataclasses.replace(job, communicator_init_s=0.0))
    assert scaled.costs.restart_s - no_setup.costs.restart_s == pytest.approx(30.0)
    assert [p.part for p in scaled.parts if p.here_s is None] == ["communicator set-up", "restore"]


def test_the_costs_file_is_checked_when_read(tmp_path: Path) -> None:
    shipped = measured_costs.load()
    assert shipped.checkpoint_ranks == 4
    assert 0 < shipped.async_staging_s <= shipped.async_blocking_s < shipped.sync_blocking_s
    assert shipped.rank_startup_s > shipped.controller_steps_s > 0
    path = tmp_path / "costs.json"
    measured_costs.save(HERE, path)
    assert measured_costs.load(path) == HERE
    body = json.loads(path.read_text())
    cases = [
        ("{", "measured costs"),
        (json.dumps([1]), "a JSON object"),
        (json.dumps({k: v for k, v in body.items() if k != "rank_startup_s"}), "rank_startup_s"),
        (json.dumps({**body, "sync_blocking_s": 0}), "sync_blocking_s must be > 0"),
        (json.dumps({**body, "async_staging_s": 9.0}), "cannot exceed"),
    ]
    for text, message in cases:
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            measured_costs.load(path)
    with pytest.raises(ValueError, match="No such file"):
        measured_costs.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="printed no line"):
        parse_checkpoint_stall("sync save: median 1.0 s blocking")


def figures(text: str) -> dict[str, float]:
    return {m[1]: float(m[2]) for m in re.finditer(r"^(\w+)=([\d.]+)$", text, flags=re.M)}


def test_the_benchmark_prints_each_comparison_and_ends_with_the_measured_ettr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    goodput.main(["--replicas", "2", "--points", "4"])
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert lines[-1].startswith("ettr_llama3_16k=")
    assert lines[-2].startswith("adaptive_vs_best_fixed=")
    assert 0.85 < figures(out)["ettr_llama3_16k"] < 1
    assert "planned" in lines[0]
    # (a): at either costs, opsd's detection is worth more than its cadence (the practice's 10 minutes is near
    # Young/Daly's interval at a 10 s save), and the two together the most
    ettr = [float(m) for m in re.findall(r" ETTR (0\.\d+), +[\d,]+ GPU-h lost a run$", out, flags=re.M)]
    assert len(ettr) == 8
    for practice, cadence, detection, both in (ettr[:4], ettr[4:]):
        assert practice - 0.002 < cadence < detection < both
    # (b): every extra unit of a cost loses ETTR
    units = "minute of relaunch|second of blocking save|minute of detection"
    losses = dict(re.findall(rf"^ {{4}}({units})\s+(\S+)%$", out, flags=re.M))
    assert set(losses) == {"minute of relaunch", "second of blocking save", "minute of detection"}
    assert all(float(v) > 0 for v in losses.values())
    # (d): replica groups beat the checkpoint restart, and more when the other groups are told of a failed one
    rows = dict(re.findall(r"^ +(checkpoint restart|\d+ groups[^:]*): ETTR (0\.\d+)", out, flags=re.M))
    assert set(rows) == {"checkpoint restart", "2 groups", "8 groups", "32 groups", "8 groups, untold"} | {
        k for k in rows if k.startswith("8 groups, heal")
    }
    told, untold, restart = (float(rows[k]) for k in ("8 groups", "8 groups, untold", "checkpoint restart"))
    assert restart < untold < told


@pytest.mark.slow
def test_the_output_of_a_real_checkpoint_stall_run_parses(tmp_path: Path) -> None:
    proc = run_module("bench.checkpoint_stall", ["--dim", "256", "--layers", "2", "--rounds", "1"], timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = parse_checkpoint_stall(proc.stdout)
    assert found["checkpoint_ranks"] == 4
    assert found["checkpoint_bytes"] > 10e6
    assert 0 <= found["async_staging_s"] <= found["async_blocking_s"]
    assert found["sync_blocking_s"] > 0
