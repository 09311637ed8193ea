"""The examples in the docs run: the README's monitor example on 2 real ranks, the protocol's example report
decodes; the MFU table is what the code computes."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import pytest

from bench.mfu_params import render_table, rows
from opsd.protocol.policy_file import parse_policy
from opsd.protocol.wire import decode
from tests.launch import ROOT, run_module


def remove(paths: Iterable[Path]) -> None:
    for path in paths:
        path.unlink()


def blocks(doc: str, language: str) -> list[str]:
    text = (ROOT / doc).read_text()
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


@pytest.mark.slow
def test_readme_monitor_example_runs_under_torchrun(tmp_path: Path) -> None:
    (example,) = [b for b in blocks("README.md", "python") if "Monitor" in b]
    script = tmp_path / "readme_example.py"
    script.write_text(example)
    proc = run_module(
        "torch.distributed.run",
        ["--standalone", "--nproc-per-node=2", str(script)],
        env={"PYTHONPATH": str(ROOT)},
        cwd=tmp_path,
        timeout_s=120,
        before_retry=lambda: remove(tmp_path.glob("steps-*.jsonl")),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0: step" in proc.stdout
    assert "rank 1: step" in proc.stdout
    for rank in (0, 1):
        lines = (tmp_path / f"steps-{rank}.jsonl").read_bytes().splitlines()
        assert [decode(line)["step"] for line in lines] == [1, 2, 3]


def test_protocol_examples_are_valid() -> None:
    step_report, policy = blocks("docs/protocol.md", "json")
    report = decode(json.dumps(json.loads(step_report)).encode())
    assert report["comms"][1] == ["tp", "all_reduce", 28, 917504, 0.019, "backward"]
    parsed = parse_policy(policy.encode())
    assert parsed.checkpoint_due(12500)
    assert [c.name for c in parsed.commands] == ["dump_flight_recorder"]


def test_checkpoint_docs_example_is_python() -> None:
    (example,) = blocks("docs/checkpoints.md", "python")
    compile(example, "docs/checkpoints.md", "exec")  # a sketch over a user's objects: it must at least parse


@pytest.mark.parametrize("doc", ["docs/planner.md", "docs/simulation.md"])
def test_python_examples_of_the_docs_run(doc: str) -> None:
    (example,) = blocks(doc, "python")
    exec(compile(example, doc, "exec"), {})


def test_mfu_table_is_what_the_code_computes() -> None:
    assert render_table(rows()) in (ROOT / "docs/mfu.md").read_text()
