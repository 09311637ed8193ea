"""The checkpointer in one process (a gloo world of one): save, commit, retention, resume choice, cadence."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore  # type: ignore[attr-defined]

from agent.reporter import write_policy
from opsd.manifest import parse_manifest
from trainer_hooks.checkpoint import CheckpointConfig, Checkpointer, TrainState, inspect_checkpoints
from trainer_hooks.policy import PolicyReader


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"]


@pytest.fixture
def world() -> Iterator[None]:
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def make_state() -> tuple[TrainState, torch.nn.Linear, Counter]:
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    counter = Counter()
    return TrainState(model, optimizer, counter=counter), model, counter


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_save_commit_and_load(world: None, tmp_path: Path, async_save: bool) -> None:
    saved: list[tuple[int, float, float, int]] = []
    config = CheckpointConfig(f"file://{tmp_path}", every_steps=2, keep_last=2, async_save=async_save)
    ckpt = Checkpointer(config, world_layout={"dp_shard": 1}, on_saved=lambda *a: saved.append(a))
    state, model, counter = make_state()
    for step in (2, 4, 6):
        counter.n = step
        ckpt.save(step, state)
    ckpt.close()
    assert [s[0] for s in saved] == [2, 4, 6]
    assert all(blocking <= total and nbytes > 0 for _, blocking, total, nbytes in saved)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000004", "step_000000006"]  # keep_last=2
    manifest = parse_manifest((tmp_path / "step_000000006" / "manifest.json").read_bytes())
    assert manifest.step == 6
    assert manifest.mesh == {"dp_shard": 1}
    assert {f.path for f in manifest.files} >= {".metadata", "__0_0.distcp"}
    weights = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    counter.n = 0
    assert ckpt.load(state) == 6
    assert counter.n == 6
    assert torch.equal(model.weight, weights)


def test_nothing_to_resume(world: None, tmp_path: Path) -> None:
    ckpt = Checkpointer(CheckpointConfig(str(tmp_path)))
    assert ckpt.load(make_state()[0]) is None
    assert inspect_checkpoints(tmp_path / "absent") == []


def test_manifest_for_another_step_is_rejected(world: None, tmp_path: Path) -> None:
    ckpt = Checkpointer(CheckpointConfig(str(tmp_path), async_save=False))
    state = make_state()[0]
    ckpt.save(3, state)
    src, dst = tmp_path / "step_000000003", tmp_path / "step_000000009"
    src.rename(dst)
    (candidate,) = inspect_checkpoints(tmp_path)
    assert candidate.problem == "manifest is for step 3, directory for step 9"


def test_cadence_follows_the_controller_policy_when_there_is_one(world: None, tmp_path: Path) -> None:
    policy_file = tmp_path / "policy.json"
    ckpt = Checkpointer(
        CheckpointConfig(str(tmp_path / "c"), every_steps=10), policy=PolicyReader(str(policy_file), check_every_s=0)
    )
    assert [s for s in range(1, 31) if ckpt.due(s)] == [10, 20, 30]  # local cadence
    write_policy(policy_file, {"checkpoint": {"every_steps": 7, "from_step": 14}})
    assert [s for s in range(1, 31) if ckpt.due(s)] == [14, 21, 28]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"url": ""}, "url must not be empty"),
        ({"url": "gs://bucket/x"}, "supported schemes"),
        ({"url": "/x", "every_steps": -1}, "every_steps must be >= 0"),
        ({"url": "/x", "keep_last": 0}, "keep_last must be >= 1"),
    ],
    ids=["empty", "scheme", "cadence", "retention"],
)
def test_config_validates_itself(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CheckpointConfig(**config)


def test_manifest_written_is_valid_json_with_checksums(world: None, tmp_path: Path) -> None:
    ckpt = Checkpointer(CheckpointConfig(str(tmp_path), async_save=False))
    ckpt.save(1, make_state()[0])
    doc = json.loads((tmp_path / "step_000000001" / "manifest.json").read_text())
    assert doc["v"] == 1
    assert all(len(f["sha256"]) == 64 for f in doc["files"])
    assert doc["versions"]["torch"] == str(torch.__version__)
