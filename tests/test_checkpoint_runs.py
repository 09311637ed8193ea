"""Checkpoints on real multi-rank runs of the reference trainer: exact resume after a rank is SIGKILLed (on a local
directory and on S3: moto's server on loopback), torn and corrupt checkpoints skipped with the reason recorded, and
resharding to a smaller mesh."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from opsd.protocol.mesh import MeshSpec
from tests.launch import run_module
from tests.s3 import CREDENTIALS

pytestmark = pytest.mark.slow

COMMON = ("--lr-warmup-steps", "5")


@pytest.fixture(scope="module")
def uninterrupted() -> dict[str, dict[str, Any]]:
    """The reference runs without a failure, by mesh: each runs once for the module (with checkpoints, as in the
    runs it is compared with), for its first test."""
    return {}


def train(
    tmp: Path, name: str, mesh: str, steps: int, *extra: str, ok: bool = True, env: Mapping[str, str] | None = None
) -> dict[str, Any] | None:
    out = tmp / f"{name}.json"
    args = ["--mesh", mesh, "--steps", str(steps), *COMMON, "--losses-out", str(out), *extra]
    nproc = MeshSpec.parse(mesh).world_size
    proc = run_module("examples.train", args, nproc=nproc, env=env)
    if not ok:
        assert proc.returncode != 0, "the run was meant to be killed"
        return None
    assert proc.returncode == 0, proc.stderr[-4000:]
    report: dict[str, Any] = json.loads(out.read_text())
    return report


# each store with one mesh (both meshes and both stores are covered; all four pairs would add two minutes)
@pytest.mark.parametrize(("where", "mesh"), [("file", "dp_shard=2,tp=2"), ("s3", "pp=2,dp_shard=2")])
def test_killed_run_resumes_to_the_same_state_bit_for_bit(
    tmp_path: Path, request: pytest.FixtureRequest, uninterrupted: dict[str, dict[str, Any]], mesh: str, where: str
) -> None:
    env: dict[str, str] = {}
    if where == "file":
        url = f"file://{tmp_path / 'ckpt'}"
    else:
        url = f"s3://ckpt/{tmp_path.name}"
        env = {**CREDENTIALS, "AWS_ENDPOINT_URL_S3": request.getfixturevalue("s3_endpoint"), "TMPDIR": str(tmp_path)}
    ckpt = ("--ckpt-dir", url, "--ckpt-every", "10")
    if mesh not in uninterrupted:
        ref = ("--ckpt-dir", str(tmp_path / "straight"), "--ckpt-every", "10")
        straight = train(tmp_path, "straight", mesh, 20, *ref)
        assert straight is not None
        uninterrupted[mesh] = straight
    straight = uninterrupted[mesh]
    train(tmp_path, "killed", mesh, 20, *ckpt, "--kill-at-step", "13", "--kill-rank", "1", ok=False, env=env)
    resumed = train(tmp_path, "resumed", mesh, 20, *ckpt, "--resume", env=env)
    assert resumed is not None
    assert resumed["resumed_from_step"] == 10
    assert resumed["resume_problems"] == []
    assert resumed["losses"] == straight["losses"][10:]
    assert resumed["state_hashes"] == straight["state_hashes"]  # model and optimizer, every rank, bitwise


def test_torn_and_corrupt_checkpoints_are_skipped_with_the_reason(tmp_path: Path) -> None:
    mesh = "dp_shard=2"
    root = tmp_path / "ckpt"
    ckpt = ("--ckpt-dir", str(root), "--ckpt-every", "5", "--ckpt-when-busy", "wait")  # every save: 5, 10, 15
    # rank 0 is SIGKILLed inside the save of step 15: every shard is written, the manifest is not
    train(tmp_path, "first", mesh, 20, *ckpt, "--kill-before-commit-step", "15", ok=False)
    first = train(tmp_path, "reference", mesh, 15, "--ckpt-dir", str(tmp_path / "ref"), "--ckpt-every", "5")
    assert first is not None
    assert sorted(p.name for p in root.iterdir()) == ["step_000000005", "step_000000010", "step_000000015"]
    torn = sorted(p.name for p in (root / "step_000000015").iterdir())
    assert torn == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # no manifest.json
    shard = root / "step_000000010" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte flipped: same size, wrong checksum
    shard.write_bytes(bytes(data))
    resumed = train(tmp_path, "resumed", mesh, 20, *ckpt, "--resume")
    assert resumed is not None
    assert resumed["resumed_from_step"] == 5
    assert resumed["resume_problems"] == [
        "step_000000015: no manifest (the save did not finish)",
        "step_000000010: __1_0.distcp: checksum mismatch",
    ]
    assert resumed["losses"][:10] == first["losses"][5:15]  # it retrained steps 6-15 identically


def test_resume_on_a_smaller_mesh_reshards(tmp_path: Path) -> None:
    ckpt = ("--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "10")
    wide = train(tmp_path, "wide", "dp_shard=4", 20, *ckpt)
    shutil.rmtree(tmp_path / "ckpt" / "step_000000020")  # resume from step 10
    narrow = train(tmp_path, "narrow", "dp_shard=2", 20, *ckpt[:2], "--resume")
    assert wide is not None
    assert narrow is not None
    assert narrow["resumed_from_step"] == 10
    # the same model on half the ranks: the loss continues where the 4-rank run was
    assert narrow["losses"] == pytest.approx(wide["losses"][10:], rel=1e-4)
