"""A checkpoint store in a local directory (``file:///path``): DCP writes the checkpoint in place; the manifest is
committed by an atomic rename."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path

from opsd.checkpoints.layout import STEP_DIR, step_dir_name
from opsd.protocol.manifest import MANIFEST_NAME


class LocalStore:
    """``file:///path`` (or a plain path): the checkpoint is the directory DCP writes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = f"file://{root}"

    def steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return [int(m.group(1)) for p in self.root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]

    def _dir(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def read_manifest(self, step: int) -> bytes | None:
        try:
            return (self._dir(step) / MANIFEST_NAME).read_bytes()
        except FileNotFoundError:
            return None

    def sizes(self, step: int) -> dict[str, int]:
        directory = self._dir(step)
        return {
            p.relative_to(directory).as_posix(): p.stat().st_size
            for p in directory.rglob("*")
            if p.is_file() and p.name != MANIFEST_NAME and not p.name.startswith(f".{MANIFEST_NAME}")
        }

    def write_dir(self, step: int) -> Path:
        return self._dir(step)

    def upload(self, step: int, names: Iterable[str]) -> None:
        return None

    def discard_spool(self, step: int, names: Iterable[str]) -> None:
        return None

    def write_manifest(self, step: int, data: bytes) -> None:
        tmp = self._dir(step) / f".{MANIFEST_NAME}.{uuid.uuid4().hex}.tmp"
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._dir(step) / MANIFEST_NAME)

    def read_dir(self, step: int, reader: str) -> Path:
        return self._dir(step)

    def fetch(self, step: int, name: str, reader: str) -> Path:
        return self._dir(step) / name

    def forget_read(self, step: int, reader: str) -> None:
        return None

    def delete(self, step: int) -> None:
        (self._dir(step) / MANIFEST_NAME).unlink(missing_ok=True)
        shutil.rmtree(self._dir(step), ignore_errors=True)
