"""What a checkpoint save writes through and a load reads through (``trainer_hooks.checkpoint``): DCP's staging with
a cached buffer, its file writer into the store hashing as it writes, and its file reader checking each file against
the manifest."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import WriteResult

from opsd.checkpoints.layout import CheckpointStore, sha256_file
from opsd.errors import PermanentError
from opsd.protocol.manifest import Manifest

DCP_METADATA = ".metadata"  # written by DCP's coordinator (rank 0) once every rank's shards are written


class ChecksumError(PermanentError):
    """A checkpoint file whose bytes do not match its manifest."""


class CachedStager(BlockingAsyncStager):
    """torch's blocking stager with a cached CPU copy, pinned only where an accelerator exists (pinning needs one:
    the parent class pins unconditionally, which fails on a CPU-only machine). Same private helpers as the parent.
    ``last_staging_s``: how long the last copy took (part of the blocking time)."""

    last_staging_s = 0.0

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        start = time.perf_counter()
        if self.state_dict_cache is None:
            self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=torch.accelerator.is_available())
        staged: dict[str, Any] = _copy_state_dict(state_dict, self.state_dict_cache)
        self.last_staging_s = time.perf_counter() - start
        return staged


class HashingStream:
    """A file being written that hashes every byte on its way in (SHA-256) and counts them; the rest is the file's."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.sha256 = hashlib.sha256()
        self.nbytes = 0

    def write(self, data: Any) -> int:
        self.sha256.update(data)  # releases the GIL on large buffers, as the write does
        self.nbytes += memoryview(data).nbytes
        written: int = self._stream.write(data)
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class HashingFileSystem(FileSystem):
    """DCP's local file system, hashing what it writes: ``hashes`` maps each file name to (SHA-256, bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.hashes: dict[str, tuple[str, int]] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hashing = HashingStream(stream)
            yield hashing  # DCP writes the file from start to end, through write() only, and closes it
            self.hashes[Path(path).name] = (hashing.sha256.hexdigest(), hashing.nbytes)


def hashes_file(rank: int) -> str:
    """Where a rank's writer leaves the SHA-256 of the shards it wrote, for the commit (not part of the checkpoint)."""
    return f".sha256-rank{rank}.json"


class StoreWriter(FileSystemWriter):
    """DCP's file writer into the store's local directory, hashing as it writes. For a remote store each rank
    uploads the files it wrote inside DCP's write phase, and the coordinator uploads ``.metadata`` in ``finish``:
    DCP runs ``finish`` only after every rank's writes returned, so when the save completes every file is in the
    store. Picklable (the process-based async save sends it to a helper process): the hashes reach the commit
    through a file of the step's local directory (``hashes_file``)."""

    def __init__(self, store: CheckpointStore, step: int, rank: int) -> None:
        super().__init__(str(store.write_dir(step)))
        self.fs = HashingFileSystem()
        self.store = store
        self.step = step
        self.owner_rank = rank  # (DCP sets its own ``rank`` at the save)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future[list[WriteResult]]:
        future = super().write_data(plan, planner)
        names = [r.storage_data.relative_path for r in future.wait()]
        assert isinstance(self.fs, HashingFileSystem)
        hashes = {name: self.fs.hashes[name] for name in names if name in self.fs.hashes}
        (self.store.write_dir(self.step) / hashes_file(self.owner_rank)).write_text(json.dumps(hashes))
        self.store.upload(self.step, names)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        self.store.upload(self.step, [DCP_METADATA])


class VerifyingReader(FileSystemReader):
    """DCP's file reader that checks each file it reads against the manifest's SHA-256 first (fetching it from a
    remote store into this process's cache). A mismatch fails the load on every rank (DCP gathers the errors)."""

    def __init__(self, store: CheckpointStore, manifest: Manifest, reader: str) -> None:
        super().__init__(str(store.read_dir(manifest.step, reader)))
        self.store = store
        self.step = manifest.step
        self.reader = reader
        self.expected = {f.path: f.sha256 for f in manifest.files}
        self.verified: set[str] = set()

    def _ensure(self, name: str) -> None:
        if name in self.verified:
            return
        if name not in self.expected:
            raise ChecksumError(f"{name}: not in the manifest")
        if sha256_file(self.store.fetch(self.step, name, self.reader)) != self.expected[name]:
            raise ChecksumError(f"{name}: checksum mismatch")
        self.verified.add(name)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self._ensure(DCP_METADATA)
        return super().read_metadata(*args, **kwargs)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        for name in sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}):
            self._ensure(name)
        return super().read_data(plan, planner)
