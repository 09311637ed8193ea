"""The layout of a checkpoint store, whatever holds it (``opsd.checkpoints.local``, ``opsd.checkpoints.s3``):

    root/step_000000010/__0_0.distcp ... .metadata manifest.json

torch's DCP always writes into a local directory (``write_dir``): for ``file://`` that is the checkpoint itself;
for ``s3://`` it is a spool directory whose files each rank then uploads (``upload``). ``manifest.json`` is written
last (``write_manifest``) and is the commit marker. Reading goes through ``fetch`` (the file itself, or a download
into a per-rank cache). ``inspect_checkpoints`` tells committed checkpoints from torn ones. Nothing here imports
torch or an SDK: the controller and the CLI inspect checkpoints with it too.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from opsd.errors import PermanentError, TransientError
from opsd.protocol.manifest import ManifestError, parse_manifest, size_problems

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step_(\d{9})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:09d}"


def sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class CheckpointStore(Protocol):
    url: str

    def steps(self) -> list[int]:
        """Every step that has a directory or prefix, committed or not, in no particular order."""
        ...

    def read_manifest(self, step: int) -> bytes | None:
        """The manifest's bytes, or None when there is none (not committed)."""
        ...

    def sizes(self, step: int) -> dict[str, int]:
        """Each file of a step (relative path -> bytes), the manifest excluded."""
        ...

    def write_dir(self, step: int) -> Path:
        """The local directory DCP writes a step into."""
        ...

    def upload(self, step: int, names: Iterable[str]) -> None:
        """Make these files of ``write_dir(step)`` durable in the store (nothing to do for a local store)."""
        ...

    def discard_spool(self, step: int, names: Iterable[str]) -> None:
        """Forget local copies written for ``upload`` (nothing for a local store)."""
        ...

    def write_manifest(self, step: int, data: bytes) -> None:
        """The commit: atomic, after every other file of the step is durable."""
        ...

    def read_dir(self, step: int, reader: str) -> Path:
        """The local directory ``fetch`` puts a step's files in for ``reader`` (a name unique per process)."""
        ...

    def fetch(self, step: int, name: str, reader: str) -> Path:
        """A local path to read one file of a step from (downloaded for a remote store)."""
        ...

    def forget_read(self, step: int, reader: str) -> None:
        """Drop what ``fetch`` downloaded for ``reader``."""
        ...

    def delete(self, step: int) -> None:
        """Remove a step's files, the manifest first (so a half-deleted step is never taken as committed)."""
        ...


@dataclass(frozen=True)
class Candidate:
    step: int
    name: str  # the step's directory name
    problem: str | None  # None: the manifest is valid and every file has its size
    total_bytes: int = 0


def inspect_checkpoints(store: CheckpointStore, *, verify_checksums: bool = False) -> list[Candidate]:
    """Every step in ``store``, newest first, with what is wrong with it (None when it can be resumed from).
    Checksums are checked while loading; ``verify_checksums`` reads every file now (local stores)."""
    out = []
    for step in sorted(store.steps(), reverse=True):
        problem, total = _problem(store, step, verify_checksums)
        out.append(Candidate(step, step_dir_name(step), problem, total))
    return out


def _problem(store: CheckpointStore, step: int, verify_checksums: bool) -> tuple[str | None, int]:
    try:
        data = store.read_manifest(step)
        if data is None:
            return "no manifest (the save did not finish)", 0
        manifest = parse_manifest(data)
        if manifest.step != step:
            return f"manifest is for step {manifest.step}, directory for step {step}", 0
        problems = size_problems(manifest, store.sizes(step))
    except (OSError, ManifestError, TransientError, PermanentError) as exc:
        return str(exc), 0
    if problems:
        return "; ".join(problems), manifest.total_bytes
    if verify_checksums:
        try:
            for f in manifest.files:
                if sha256_file(store.fetch(step, f.path, "inspect")) != f.sha256:
                    return f"{f.path}: checksum mismatch", manifest.total_bytes
        finally:
            store.forget_read(step, "inspect")
    return None, manifest.total_bytes
