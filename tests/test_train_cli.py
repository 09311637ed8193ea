"""The trainer's command line: an impossible layout stops before any process group, with one line naming why."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from examples.train import main
from tests.launch import run_module

BAD = {
    "product differs from world": (4, ["--mesh", "dp_shard=2"], "must equal the world size 4"),
    "tp does not divide heads": (3, ["--mesh", "tp=3"], "tp=3 must divide the attention heads (4)"),
    "pp larger than layers": (8, ["--mesh", "pp=8"], "pp=8 must not exceed the layers (4)"),
    "ep does not divide experts": (3, ["--mesh", "ep=3", "--experts", "4"], "ep=3 must divide the experts (4)"),
    "ep without experts": (2, ["--mesh", "ep=2"], "ep=2 needs MoE layers (--experts)"),
    "unknown dimension": (2, ["--mesh", "dp=2"], "unknown dimension 'dp'"),
    "bad model": (1, ["--heads", "3"], "model.n_heads=3 must divide model.dim=64"),
}


@pytest.mark.parametrize(("world", "argv", "message"), BAD.values(), ids=BAD.keys())
def test_bad_layout_exits_2_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], world: int, argv: list[str], message: str
) -> None:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("examples.train: error: mesh:") or err.startswith("examples.train: error: model")
    assert message in err
    assert not dist.is_initialized()


@pytest.mark.slow
def test_bad_layout_under_torchrun_fails_fast() -> None:
    proc = run_module(
        "examples.train", ["--mesh", "tp=2,pp=1", "--heads", "4", "--kv-heads", "1"], nproc=2, timeout_s=120
    )
    assert proc.returncode != 0
    assert "tp=2 must divide the key/value heads (1)" in proc.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--resume"], "--resume needs --ckpt-dir"),
        (["--ckpt-dir", "gs://bucket/run"], "supported schemes are file://"),
        (["--ckpt-dir", "/tmp/c", "--ckpt-keep-last", "0"], "retention.keep_last must be >= 1"),
        (["--ckpt-every", "-1"], "--ckpt-every must be >= 0"),
        (["--ckpt-dir", "s3://b/p", "--ckpt-s3-endpoint", "minio:9000"], "must be an http:// or https:// URL"),
    ],
    ids=["resume-without-dir", "scheme", "keep-last", "negative-cadence", "s3-endpoint"],
)
def test_bad_checkpoint_arguments_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert message in err
    assert not dist.is_initialized()


FT_ENV = {"TORCHFT_LIGHTHOUSE": "http://127.0.0.1:29510", "REPLICA_GROUP_ID": "0", "NUM_REPLICA_GROUPS": "2"}


@pytest.mark.parametrize(
    ("env", "argv", "message"),
    [
        ({}, ["--mesh", "dp_replicate=2"], "TORCHFT_LIGHTHOUSE is not set"),
        ({**FT_ENV, "REPLICA_GROUP_ID": "x"}, ["--mesh", "dp_replicate=2"], "REPLICA_GROUP_ID must be an integer"),
        (FT_ENV, ["--mesh", "dp_replicate=2,dp_shard=2"], "must equal the world size 2"),  # a group of one rank
        (FT_ENV, ["--mesh", "dp_shard=2"], "dp_replicate=1 must equal NUM_REPLICA_GROUPS=2"),
    ],
    ids=["no-lighthouse", "group-not-a-number", "group-world-too-small", "no-replicas"],
)
def test_bad_fault_tolerant_settings_exit_2(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    env: dict[str, str],
    argv: list[str],
    message: str,
) -> None:
    for name in ("TORCHFT_LIGHTHOUSE", "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["--ft", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert message in err
    assert not dist.is_initialized()
