"""``bench.checkpoint_stall``'s check of every save's commit, on a real local store: a complete manifest passes; a
missing, torn or short one, or one that leaves out a rank or the bytes a rank wrote, is named."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.checkpoint_stall import manifest_problem
from opsd.checkpoints.layout import CheckpointStore
from opsd.checkpoints.store import open_store
from opsd.protocol.manifest import Manifest, ManifestFile, encode_manifest

STEP = 7
FILES = {"__0_0.distcp": b"a" * 300, "__1_0.distcp": b"b" * 200, ".metadata": b"m" * 50}
WRITTEN = sum(len(data) for data in FILES.values())


def step_dir(store: CheckpointStore) -> Path:
    directory = store.write_dir(STEP)
    directory.mkdir(parents=True, exist_ok=True)  # as DCP's writer does
    return directory


def commit(store: CheckpointStore, files: dict[str, bytes], listed: list[str] | None = None) -> None:
    """Write ``files`` into the step's directory and a manifest listing ``listed`` of them (all by default)."""
    directory = step_dir(store)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    entries = [ManifestFile(n, len(files[n]), hashlib.sha256(files[n]).hexdigest()) for n in listed or list(files)]
    manifest = Manifest(v=1, step=STEP, time_unix_s=0.0, world_size=2, mesh={}, files=entries, versions={})
    store.write_manifest(STEP, encode_manifest(manifest))


def truncate(store: CheckpointStore) -> None:
    commit(store, FILES)
    (step_dir(store) / "__1_0.distcp").write_bytes(b"b" * 100)


CASES: dict[str, tuple[Callable[[CheckpointStore], object], int, str | None]] = {
    "complete": (lambda s: commit(s, FILES), WRITTEN, None),
    "no save at all": (lambda s: None, WRITTEN, "no checkpoint directory"),
    "written, never committed": (
        lambda s: step_dir(s).joinpath("__0_0.distcp").write_bytes(b"a"),
        1,
        "no manifest",
    ),
    "a file shorter than listed": (truncate, WRITTEN, "__1_0.distcp"),
    "a rank left out": (
        lambda s: commit(s, FILES, ["__0_0.distcp", ".metadata"]),
        WRITTEN,
        "the manifest lists no shard of rank(s) [1]",
    ),
    "DCP's metadata left out": (
        lambda s: commit(s, FILES, ["__0_0.distcp", "__1_0.distcp"]),
        WRITTEN,
        "the manifest does not list .metadata",
    ),
    "fewer bytes than the ranks wrote": (
        lambda s: commit(s, FILES),
        WRITTEN + 10,
        f"the manifest lists {WRITTEN} bytes, the ranks wrote {WRITTEN + 10}",
    ),
}


@pytest.mark.parametrize(("make", "written", "expected"), CASES.values(), ids=CASES.keys())
def test_manifest_problem(
    tmp_path: Path, make: Callable[[CheckpointStore], object], written: int, expected: str | None
) -> None:
    store = open_store(str(tmp_path / "ckpt"))
    make(store)
    problem = manifest_problem(store, STEP, world_size=2, nbytes=written)
    if expected is None:
        assert problem is None
    else:
        assert problem is not None
        assert expected in problem, problem
