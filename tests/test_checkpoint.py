"""The checkpointer in one process (a gloo world of one): save, commit, retention, resume choice, cadence."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch

from opsd.checkpoints.layout import inspect_checkpoints, sha256_file
from opsd.checkpoints.local import LocalStore
from opsd.checkpoints.s3 import S3Options
from opsd.errors import PermanentError
from opsd.protocol.manifest import parse_manifest
from opsd.protocol.policy_file import CheckpointCadence, Policy
from opsd_agent.reporter import write_policy
from trainer_hooks import checkpoint as checkpoint_module
from trainer_hooks.checkpoint import CheckpointConfig, Checkpointer, TrainState
from trainer_hooks.policy_reader import PolicyReader


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"]


def make_state() -> tuple[TrainState, torch.nn.Linear, Counter]:
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    counter = Counter()
    return TrainState(model, optimizer, counter=counter), model, counter


def s3_config(s3_endpoint: str, tmp_path: Path, **kwargs: Any) -> CheckpointConfig:
    options = S3Options(endpoint_url=s3_endpoint, spool_dir=str(tmp_path / "spool"))
    return CheckpointConfig(f"s3://ckpt/{tmp_path.name}", s3=options, **kwargs)


@pytest.mark.parametrize(
    ("where", "async_save"),
    [("file", True), ("file", False), ("s3", True), ("s3", False)],
    ids=["file-async", "file-sync", "s3-async", "s3-sync"],
)
def test_save_commit_and_load(
    gloo_world: None, tmp_path: Path, request: pytest.FixtureRequest, where: str, async_save: bool
) -> None:
    saved: list[dict[str, Any]] = []
    if where == "file":
        config = CheckpointConfig(f"file://{tmp_path}", every_steps=2, keep_last=2, async_save=async_save)
    else:
        config = s3_config(request.getfixturevalue("s3_endpoint"), tmp_path, keep_last=2, async_save=async_save)
    ckpt = Checkpointer(config, world_layout={"dp_shard": 1}, on_saved=lambda **kw: saved.append(kw))
    state, model, counter = make_state()
    for step in (2, 4, 6):
        counter.n = step
        ckpt.save(step, state, wait=True)  # back to back: each waits for the previous one's write
    ckpt.close()
    assert [s["step"] for s in saved] == [2, 4, 6]
    assert all(s["staging_s"] <= s["blocking_s"] <= s["total_s"] and s["nbytes"] > 0 for s in saved)
    assert all((s["staging_s"] > 0) == async_save for s in saved)
    found = inspect_checkpoints(ckpt.store)
    assert [(c.step, c.problem) for c in found] == [(6, None), (4, None)]  # keep_last=2
    manifest = parse_manifest(ckpt.store.read_manifest(6) or b"")
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


def test_nothing_to_resume(gloo_world: None, tmp_path: Path) -> None:
    ckpt = Checkpointer(CheckpointConfig(str(tmp_path)))
    assert ckpt.load(make_state()[0]) is None
    assert inspect_checkpoints(LocalStore(tmp_path / "absent")) == []


def test_manifest_for_another_step_is_rejected(gloo_world: None, tmp_path: Path) -> None:
    ckpt = Checkpointer(CheckpointConfig(str(tmp_path), async_save=False))
    state = make_state()[0]
    ckpt.save(3, state)
    src, dst = tmp_path / "step_000000003", tmp_path / "step_000000009"
    src.rename(dst)
    (candidate,) = inspect_checkpoints(ckpt.store)
    assert candidate.problem == "manifest is for step 3, directory for step 9"


def test_cadence_follows_the_controller_policy_when_there_is_one(gloo_world: None, tmp_path: Path) -> None:
    policy_file = tmp_path / "policy.json"
    ckpt = Checkpointer(
        CheckpointConfig(str(tmp_path / "c"), every_steps=10), policy=PolicyReader(str(policy_file), check_every_s=0)
    )
    assert [s for s in range(1, 31) if ckpt.due(s)] == [10, 20, 30]  # local cadence
    write_policy(policy_file, Policy(checkpoint=CheckpointCadence(every_steps=7, from_step=14)))
    assert [s for s in range(1, 31) if ckpt.due(s)] == [10, 14, 21, 28]  # local until the policy's step 14


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"url": ""}, "url must not be empty"),
        ({"url": "gs://bucket/x"}, "supported schemes"),
        ({"url": "s3:///x"}, "no bucket"),
        ({"url": "/x", "async_mode": "fork"}, "expected thread or process"),
        ({"url": "/x", "when_busy": "queue"}, "expected skip or wait"),
        ({"url": "/x", "every_steps": -1}, "every_steps must be >= 0"),
        ({"url": "/x", "keep_last": 0}, "keep_last must be >= 1"),
    ],
    ids=["empty", "scheme", "bucket", "async-mode", "when-busy", "cadence", "retention"],
)
def test_config_validates_itself(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CheckpointConfig(**config)


def test_a_save_due_while_the_previous_one_writes_is_skipped_and_counted(gloo_world: None, tmp_path: Path) -> None:
    """The first save's commit is held until the test lets it go: a save due meanwhile does not wait for it."""
    release, committing = threading.Event(), threading.Event()

    def hold(step: int) -> None:  # runs on the writer's thread just before the manifest
        committing.set()
        assert release.wait(30)

    skipped: list[int] = []
    saved: list[int] = []
    ckpt = Checkpointer(
        CheckpointConfig(str(tmp_path)),
        before_commit=hold,
        on_skipped=skipped.append,
        on_saved=lambda **kw: saved.append(kw["step"]),
    )
    state = make_state()[0]
    ckpt.save(10, state)
    assert committing.wait(30)
    assert ckpt.writing()
    assert ckpt.save(20, state) == 0.0  # skipped: training goes on at once
    assert (ckpt.skipped, skipped) == (1, [20])
    release.set()
    ckpt.wait()
    assert not ckpt.writing()
    ckpt.save(30, state)  # nothing in flight: saved
    ckpt.close()
    assert saved == [10, 30]
    assert sorted(c.step for c in inspect_checkpoints(ckpt.store) if c.problem is None) == [10, 30]


def test_a_save_that_must_happen_waits_for_the_previous_write(gloo_world: None, tmp_path: Path) -> None:
    release = threading.Event()

    def hold(step: int) -> None:
        release.wait(30)

    ckpt = Checkpointer(CheckpointConfig(str(tmp_path)), before_commit=hold)
    state = make_state()[0]
    ckpt.save(10, state)
    threading.Timer(0.2, release.set).start()  # lets the first write finish, whenever save(20) waits for it
    ckpt.save(20, state, wait=True)  # the run's last save: waits for the write of step 10, then saves
    ckpt.close()
    assert (ckpt.skipped, ckpt.waits) == (0, 1)
    assert sorted(c.step for c in inspect_checkpoints(ckpt.store) if c.problem is None) == [10, 20]


def test_shards_are_hashed_as_they_are_written_not_read_back(
    gloo_world: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    read_back: list[str] = []

    def reading(path: Path) -> str:
        read_back.append(path.name)
        return sha256_file(path)

    monkeypatch.setattr(checkpoint_module, "sha256_file", reading)
    ckpt = Checkpointer(CheckpointConfig(str(tmp_path), async_save=False))
    ckpt.save(1, make_state()[0])
    manifest = parse_manifest((tmp_path / "step_000000001" / "manifest.json").read_bytes())
    directory = tmp_path / "step_000000001"
    assert {f.path: f.sha256 for f in manifest.files} == {
        f.path: sha256_file(directory / f.path) for f in manifest.files
    }
    assert read_back == [".metadata"]  # the shards' hashes were taken on their way to disk
    assert not any(p.name.startswith(".sha256") for p in directory.iterdir())  # their note is not left behind


def test_manifest_written_is_valid_json_with_checksums(gloo_world: None, tmp_path: Path) -> None:
    ckpt = Checkpointer(CheckpointConfig(str(tmp_path), async_save=False))
    ckpt.save(1, make_state()[0])
    doc = json.loads((tmp_path / "step_000000001" / "manifest.json").read_text())
    assert doc["v"] == 1
    assert all(len(f["sha256"]) == 64 for f in doc["files"])
    assert doc["versions"]["torch"] == str(torch.__version__)


def corrupt_one_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, wrong checksum
    path.write_bytes(bytes(data))


def test_a_corrupt_shard_is_caught_while_loading_and_the_previous_checkpoint_is_used(
    gloo_world: None, tmp_path: Path
) -> None:
    ckpt = Checkpointer(CheckpointConfig(str(tmp_path), async_save=False))
    state, _, counter = make_state()
    for step in (1, 2):
        counter.n = step
        ckpt.save(step, state)
    corrupt_one_byte(tmp_path / "step_000000002" / "__0_0.distcp")
    assert inspect_checkpoints(ckpt.store)[0].problem is None  # the size is right: only the checksum tells
    counter.n = 0
    assert ckpt.load(state) == 1
    assert counter.n == 1
    assert ckpt.resume_problems == ["step_000000002: __0_0.distcp: checksum mismatch"]


def test_on_s3_the_object_is_checked_not_a_local_copy(gloo_world: None, tmp_path: Path, s3_endpoint: str) -> None:
    ckpt = Checkpointer(s3_config(s3_endpoint, tmp_path, async_save=False))
    state, _, counter = make_state()
    for step in (1, 2):
        counter.n = step
        ckpt.save(step, state)
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    key = f"{tmp_path.name}/step_000000002/__0_0.distcp"
    body = bytearray(client.get_object(Bucket="ckpt", Key=key)["Body"].read())
    body[len(body) // 2] ^= 0xFF
    client.put_object(Bucket="ckpt", Key=key, Body=bytes(body))
    assert ckpt.load(state) == 1
    assert ckpt.resume_problems == ["step_000000002: __0_0.distcp: checksum mismatch"]
    assert not (tmp_path / "spool").exists() or not any((tmp_path / "spool").rglob("*.distcp"))  # cache dropped


def test_process_based_async_save(gloo_world: None, tmp_path: Path) -> None:
    saved: list[dict[str, Any]] = []
    config = CheckpointConfig(str(tmp_path), async_mode="process")
    ckpt = Checkpointer(config, on_saved=lambda **kw: saved.append(kw))
    state, model, counter = make_state()
    counter.n = 5
    ckpt.save(5, state)
    ckpt.close()
    assert [s["step"] for s in saved] == [5]
    weights = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    assert ckpt.load(state) == 5
    assert torch.equal(model.weight, weights)


def test_when_every_checkpoint_fails_to_load_training_does_not_start_from_a_half_loaded_state(
    gloo_world: None, tmp_path: Path
) -> None:
    ckpt = Checkpointer(CheckpointConfig(str(tmp_path), async_save=False))
    state = make_state()[0]
    ckpt.save(1, state)
    corrupt_one_byte(tmp_path / "step_000000001" / "__0_0.distcp")
    with pytest.raises(PermanentError, match=r"could be loaded: step_000000001: __0_0.distcp: checksum mismatch"):
        ckpt.load(state)
