"""The checkpoint manifest (commit marker) and the retention policy: tables of named cases."""

from __future__ import annotations

import json
from typing import Any

import pytest

from opsd.policy.retention import Retention, select_deletions
from opsd.protocol.manifest import Manifest, ManifestError, ManifestFile, encode_manifest, parse_manifest, size_problems

SHA = "ab" * 32


def manifest(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "v": 1,
        "step": 10,
        "time_unix_s": 1.7e9,
        "world_size": 4,
        "mesh": {"dp_shard": 2, "tp": 2},
        "files": [
            {"path": "__0_0.distcp", "bytes": 100, "sha256": SHA},
            {"path": ".metadata", "bytes": 7, "sha256": SHA},
        ],
        "versions": {"torch": "2.13.0", "opsd": "0.1.0"},
    }
    base.update(changes)
    return base


def test_round_trip() -> None:
    m = parse_manifest(json.dumps(manifest()).encode())
    assert m.total_bytes == 107
    assert parse_manifest(encode_manifest(m)) == m


def file(path: str, sha: str = SHA) -> dict[str, Any]:
    return {"path": path, "bytes": 1, "sha256": sha}


def without(name: str) -> dict[str, Any]:
    m = manifest()
    del m[name]
    return m


BAD: dict[str, tuple[dict[str, Any] | bytes, str]] = {
    "not json": (b"{", "not JSON"),
    "unknown version": (manifest(v=2), "unsupported version"),
    "no version": (without("v"), "missing required field `v`"),
    "missing files": (without("files"), "missing required field `files`"),
    "missing step": (without("step"), "missing required field `step`"),
    "negative step": (manifest(step=-1), "`$.step`"),
    "no files": (manifest(files=[]), "`$.files`"),
    "absolute path": (manifest(files=[file("/etc/passwd")]), "leaves the checkpoint's directory"),
    "parent path": (manifest(files=[file("../step_9/__0_0.distcp")]), "leaves the checkpoint's directory"),
    "sneaky parent": (manifest(files=[file("a/../../x")]), "leaves the checkpoint's directory"),
    "backslash": (manifest(files=[file("..\\\\x")]), "leaves the checkpoint's directory"),
    "the manifest itself": (manifest(files=[file("manifest.json")]), "leaves the checkpoint's directory"),
    "duplicate": (manifest(files=[file("a"), file("a")]), "listed twice"),
    "bad checksum": (manifest(files=[file("a", sha="xyz")]), "malformed sha256"),
    "string size": (manifest(files=[{"path": "a", "bytes": "1", "sha256": SHA}]), "`$.files[0].bytes`"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_manifest_is_rejected_clearly(name: str) -> None:
    doc, message = BAD[name]
    data = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    with pytest.raises(ManifestError) as info:
        parse_manifest(data)
    assert message in str(info.value)


def test_size_problems() -> None:
    m = Manifest(1, 1, 0.0, 1, {}, [ManifestFile("a", 3, SHA), ManifestFile("b", 4, SHA)], {})
    assert size_problems(m, {"a": 3, "b": 4, "extra": 1}) == []
    assert size_problems(m, {"a": 2}) == ["a: 2 bytes, manifest says 3", "b: missing"]


CASES: dict[str, tuple[list[int], list[int], Retention, list[int]]] = {
    "nothing yet": ([], [5], Retention(keep_last=1), []),
    "keep last 2": ([10, 20, 30, 40], [], Retention(keep_last=2), [10, 20]),
    "keep every 100": ([100, 150, 200, 250, 300], [], Retention(keep_last=1, keep_every_steps=100), [150, 250]),
    "old torn deleted": ([10, 20], [15], Retention(keep_last=2), [15]),
    "newer torn kept (in progress)": ([10, 20], [30], Retention(keep_last=1), [10]),
    "newest always kept": ([10], [], Retention(keep_last=1), []),
}


@pytest.mark.parametrize("name", CASES)
def test_retention(name: str) -> None:
    committed, torn, retention, expected = CASES[name]
    assert select_deletions(committed, torn, retention) == expected


@pytest.mark.parametrize(("keep_last", "every"), [(0, 0), (1, -1)])
def test_retention_validates_itself(keep_last: int, every: int) -> None:
    with pytest.raises(ValueError, match="retention"):
        Retention(keep_last=keep_last, keep_every_steps=every)
