"""The checkpoint manifest: the commit marker of a checkpoint, written last (docs/checkpoints.md).

A checkpoint directory (or S3 prefix) holds the shards of one step and, once every shard is written, a
``manifest.json`` naming each file with its size and SHA-256. Only a checkpoint with a valid manifest is ever
resumed from. Parsing is strict: a manifest with a missing field, an unknown version, a bad checksum or a path
that leaves its directory is rejected with a ``ManifestError`` that says which.
"""

from __future__ import annotations

import posixpath
import re
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

from opsd.errors import PermanentError

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class ManifestError(PermanentError, ValueError):
    """A manifest that cannot be trusted; the text says why."""


class ManifestFile(Struct, frozen=True):
    path: str  # relative to the checkpoint's directory, '/'-separated
    bytes: Annotated[int, Meta(ge=0)]
    sha256: str


class Manifest(Struct, frozen=True):
    v: Literal[1]
    step: Annotated[int, Meta(ge=0)]
    time_unix_s: float
    world_size: Annotated[int, Meta(ge=1)]
    mesh: dict[str, Annotated[int, Meta(ge=1)]]
    files: Annotated[list[ManifestFile], Meta(min_length=1)]
    versions: dict[str, str]
    blocking_s: Annotated[float, Meta(ge=0)] | None = None  # the longest any rank's training was stopped by the save
    save_s: Annotated[float, Meta(ge=0)] | None = None  # rank 0's save, from its start to the commit

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)


def safe_relative_path(path: str) -> bool:
    """Whether ``path`` stays inside its checkpoint directory: relative, normalised, no ``..``, no backslash."""
    if not path or path.startswith("/") or "\\" in path or "\x00" in path:
        return False
    normal = posixpath.normpath(path)
    return normal == path and not normal.startswith("..") and normal not in (".", MANIFEST_NAME)


def parse_manifest(data: bytes) -> Manifest:
    try:
        manifest = msgspec.json.decode(data, type=Manifest)
    except msgspec.ValidationError as exc:
        if "`$.v`" in str(exc):
            raise ManifestError(f"manifest: unsupported version ({exc}); known: {MANIFEST_VERSION}") from None
        raise ManifestError(f"manifest: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ManifestError(f"manifest: not JSON: {exc}") from None
    seen = set()
    for f in manifest.files:
        if not safe_relative_path(f.path):
            raise ManifestError(f"manifest: file path {f.path!r} leaves the checkpoint's directory")
        if f.path in seen:
            raise ManifestError(f"manifest: file {f.path!r} listed twice")
        seen.add(f.path)
        if not _SHA256.match(f.sha256):
            raise ManifestError(f"manifest: file {f.path!r} has a malformed sha256")
    return manifest


def encode_manifest(manifest: Manifest) -> bytes:
    return msgspec.json.format(msgspec.json.encode(manifest), indent=1)


def size_problems(manifest: Manifest, sizes: dict[str, int]) -> list[str]:
    """What is wrong with the files found (path -> size) against the manifest; empty when they agree."""
    problems = []
    for f in manifest.files:
        if f.path not in sizes:
            problems.append(f"{f.path}: missing")
        elif sizes[f.path] != f.bytes:
            problems.append(f"{f.path}: {sizes[f.path]} bytes, manifest says {f.bytes}")
    return problems
