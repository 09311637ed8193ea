"""The examples in the docs run: the README's monitor example on 2 real ranks, the checkpoint example over a real
model in a world of one, the protocol's example report decodes; the MFU table is what the code computes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore  # type: ignore[attr-defined]

from bench.mfu_params import render_table, rows
from opsd.checkpoints.layout import inspect_checkpoints
from opsd.checkpoints.local import LocalStore
from opsd.protocol.policy_file import decode_policy
from opsd.protocol.wire import decode
from tests.launch import ROOT, run_module


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
    parsed = decode_policy(policy.encode())
    assert parsed.checkpoint_due(12500)
    assert [c.name for c in parsed.commands or ()] == ["dump_flight_recorder"]
    assert [(f.group, f.incident) for f in parsed.failed_groups or ()] == [(1, 12)]


class Position:
    """A data loader's position: state the checkpoint keeps besides model and optimizer."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]


class SavedCheckpoints:
    """Where the example sends ``on_saved``: the checkpoints committed, as a monitor counts them."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def record_checkpoint(self, **saved: Any) -> None:
        self.steps.append(saved["step"])


def user_objects() -> dict[str, Any]:
    """What the example takes from the user's trainer: a small model trained for real, its optimizer and schedule,
    the loader's position, the monitor's checkpoint callback."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader_state = Position()
    inputs = torch.randn(16, 8)

    def train_step() -> None:
        model(inputs).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        loader_state.step += 1

    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100)
    return {
        "model": model,
        "optimizer": optimizer,
        "loader_state": loader_state,
        "lr_scheduler": lr_scheduler,
        "monitor": SavedCheckpoints(),
        "train_step": train_step,
        "total_steps": 1000,
    }


def test_checkpoint_docs_example_saves_and_resumes(tmp_path: Path) -> None:
    """The example of docs/checkpoints.md over real objects in a gloo world of one (its URL moved under tmp): it
    commits the checkpoints of steps 500 and 1000; run again, it resumes at step 1000 with the same weights, loader
    position and schedule, and trains no further."""
    (example,) = blocks("docs/checkpoints.md", "python")
    url = "file:///ckpt/run-1"
    assert url in example
    code = compile(example.replace(url, f"file://{tmp_path}"), "docs/checkpoints.md", "exec")
    first, again = user_objects(), user_objects()
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        exec(code, first)
        exec(code, again)
    finally:
        dist.destroy_process_group()
    committed = [c.step for c in inspect_checkpoints(LocalStore(tmp_path)) if c.problem is None]
    assert committed == [1000, 500]
    assert (first["start"], first["monitor"].steps, first["loader_state"].step) == (0, [500, 1000], 1000)
    assert (again["start"], again["monitor"].steps, again["loader_state"].step) == (1000, [], 1000)
    assert torch.equal(again["model"].weight, first["model"].weight)
    assert again["lr_scheduler"].state_dict() == first["lr_scheduler"].state_dict()


@pytest.mark.parametrize("doc", ["docs/planner.md", "docs/simulation.md"])
def test_python_examples_of_the_docs_run(doc: str) -> None:
    (example,) = blocks(doc, "python")
    exec(compile(example, doc, "exec"), {})


def test_mfu_table_is_what_the_code_computes() -> None:
    assert render_table(rows()) in (ROOT / "docs/mfu.md").read_text()
