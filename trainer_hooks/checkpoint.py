"""Sharded, asynchronous checkpoints with an atomic commit and validated resume (docs/checkpoints.md).

    ckpt = Checkpointer(CheckpointConfig("file:///ckpt/run1", every_steps=500), world_layout={"dp_shard": 8})
    restored = ckpt.load(state)              # the newest committed checkpoint that validates, or None
    for step in range(restored or 0, steps):
        train_step()
        if ckpt.due(step + 1):
            ckpt.save(step + 1, state)       # stages to CPU, writes in the background
    ckpt.close()

``state`` is a ``TrainState``: the model and optimizer (through ``torch.distributed.checkpoint.state_dict``,
so FSDP2 / DTensor / pipeline-stage models are saved sharded and resharded on load), plus any other state
objects (data position, LR schedule) and every rank's RNG state.

Layout: one directory per step (``step_000000010``); DCP's shards and ``.metadata`` first; then rank 0, once
every rank's shards are written, writes ``manifest.json`` (each file's size and SHA-256, the mesh layout,
versions) atomically, last: the commit marker. A directory without a valid manifest is never loaded.

At most one save is in flight: a save requested while the previous one is still writing waits for it (all ranks
wait alike, so they stay in step: a checkpoint is a collective), and the wait is counted. Saves use their own
gloo process group, so background writes never interleave with the training's collectives.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import opsd
from opsd.errors import ConfigError
from opsd.manifest import MANIFEST_NAME, Manifest, ManifestError, ManifestFile, encode_manifest, parse_manifest
from opsd.manifest import size_problems as manifest_size_problems
from opsd.policy.retention import Retention, select_deletions
from trainer_hooks.policy import PolicyReader

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step_(\d{9})$")
# Optimizer state keyed by parameter name: pipeline stages hold different parameters, and nested param_groups
# lists would collide across them.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class CheckpointConfig:
    url: str  # file:///path or a plain path
    every_steps: int = 0  # local cadence when no controller policy says otherwise (0: only the policy)
    keep_last: int = 3
    keep_every_steps: int = 0
    async_save: bool = True

    def __post_init__(self) -> None:
        if not self.url:
            raise ValueError("checkpoint.url must not be empty")
        if "://" in self.url and not self.url.startswith("file://"):
            raise ValueError(f"checkpoint.url {self.url!r}: supported schemes are file:// (or a plain path)")
        if self.every_steps < 0:
            raise ValueError("checkpoint.every_steps must be >= 0")
        Retention(self.keep_last, self.keep_every_steps)  # validates them

    @property
    def root(self) -> Path:
        return Path(self.url.removeprefix("file://"))


class TrainState:
    """What a checkpoint holds: model, optimizer, named extra state, and each rank's RNG state."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **extra: Stateful) -> None:
        self.model = model
        self.optimizer = optimizer
        self.extra = extra

    def state_dict(self, rank: int) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=OPTIONS)
        return {
            "model": model_sd,
            "optim": optim_sd,
            **{name: obj.state_dict() for name, obj in self.extra.items()},
            f"rng_rank{rank}": {"cpu": torch.get_rng_state()},
        }

    def load_state_dict(self, state: dict[str, Any], rank: int, restore_rng: bool) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        for name, obj in self.extra.items():
            obj.load_state_dict(state[name])
        if restore_rng:
            torch.set_rng_state(state[f"rng_rank{rank}"]["cpu"])


class _CachedStager(BlockingAsyncStager):
    """torch's blocking stager with a cached CPU copy, pinned only where an accelerator exists (pinning needs one:
    the parent class pins unconditionally, which fails on a CPU-only machine). Same private helpers as the parent."""

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self.state_dict_cache is None:
            self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=torch.accelerator.is_available())
        staged: dict[str, Any] = _copy_state_dict(state_dict, self.state_dict_cache)
        return staged


def step_dir_name(step: int) -> str:
    return f"step_{step:09d}"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class Candidate:
    step: int
    path: Path
    problem: str | None  # None: valid


def inspect_checkpoints(root: Path, *, verify_checksums: bool = True) -> list[Candidate]:
    """Every step directory under ``root``, newest first, with what is wrong with it (None when valid)."""
    if not root.is_dir():
        return []
    out = []
    for entry in sorted(root.iterdir(), reverse=True):
        match = STEP_DIR.match(entry.name)
        if not match or not entry.is_dir():
            continue
        out.append(Candidate(int(match.group(1)), entry, _problem(entry, int(match.group(1)), verify_checksums)))
    return out


def _problem(path: Path, step: int, verify_checksums: bool) -> str | None:
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.exists():
        return "no manifest (the save did not finish)"
    try:
        manifest = parse_manifest(manifest_path.read_bytes())
    except (OSError, ManifestError) as exc:
        return str(exc)
    if manifest.step != step:
        return f"manifest is for step {manifest.step}, directory for step {step}"
    sizes = {f.path: (path / f.path).stat().st_size for f in manifest.files if (path / f.path).is_file()}
    problems = manifest_size_problems(manifest, sizes)
    if problems:
        return "; ".join(problems)
    if verify_checksums:
        for f in manifest.files:
            if sha256_file(path / f.path) != f.sha256:
                return f"{f.path}: checksum mismatch"
    return None


class Checkpointer:
    def __init__(
        self,
        config: CheckpointConfig,
        *,
        world_layout: dict[str, int] | None = None,
        policy: PolicyReader | None = None,
        on_saved: Callable[[int, float, float, int], None] | None = None,
    ) -> None:
        """``on_saved(step, blocking_s, total_s, bytes)`` runs when this rank's part of a save is written (e.g.
        ``Monitor.record_checkpoint``). Collective: every rank constructs it (it creates a process group)."""
        self.config = config
        self.root = config.root
        self.layout = dict(world_layout or {})
        self.policy = policy
        self.on_saved = on_saved
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.group = dist.new_group(backend="gloo")
        self.retention = Retention(config.keep_last, config.keep_every_steps)
        self.waits = 0  # saves that had to wait for the previous one
        self.resume_problems: list[str] = []
        self._inflight: tuple[Future[Any], threading.Event] | None = None
        # One staging buffer for the run: each save copies into it instead of allocating the state anew.
        self._stager = _CachedStager(cache_staged_state_dict=True) if config.async_save else None
        self._lock = threading.Lock()
        if self.rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"checkpoint directory {self.root}: {exc}") from None

    # -- cadence -------------------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """Whether to save after ``step``: the controller's cadence when it published one, else the local one."""
        if self.policy is not None:
            policy = self.policy.current()
            if policy.checkpoint_every_steps is not None:
                return policy.checkpoint_due(step)
        return self.config.every_steps > 0 and step % self.config.every_steps == 0

    # -- save ----------------------------------------------------------------------------------------------------
    def save(self, step: int, state: TrainState) -> float:
        """Save ``state`` as the checkpoint of ``step``; returns the blocking seconds."""
        start = time.perf_counter()
        with self._lock:
            busy = self._inflight is not None and not self._inflight[1].is_set()
        if busy:
            self.waits += 1
        self.wait()
        directory = self.root / step_dir_name(step)
        state_dict = state.state_dict(self.rank)
        writer = FileSystemWriter(str(directory))
        if self.config.async_save:
            future = dcp_async_save(
                state_dict, storage_writer=writer, process_group=self.group, async_stager=self._stager
            )
            blocking_s = time.perf_counter() - start
            assert isinstance(future, Future)
            committed = threading.Event()

            def written(f: Future[Any]) -> None:
                try:
                    self._written(f, step, directory, start, blocking_s)
                finally:
                    committed.set()

            future.add_done_callback(written)
            with self._lock:
                self._inflight = (future, committed)
        else:
            dcp_save(state_dict, storage_writer=writer, process_group=self.group)
            blocking_s = time.perf_counter() - start
            done: Future[Any] = Future()
            done.set_result(None)
            self._written(done, step, directory, start, blocking_s)
        return blocking_s

    def _written(self, future: Future[Any], step: int, directory: Path, start: float, blocking_s: float) -> None:
        """This rank's shards are written (on the saving thread): rank 0 commits, everyone reports."""
        try:
            future.result()
            if self.rank == 0:
                self._commit(step, directory)
                self._apply_retention()
            total_s = time.perf_counter() - start
            nbytes = sum(p.stat().st_size for p in directory.glob(f"__{self.rank}_*"))
            if self.on_saved is not None:
                self.on_saved(step, blocking_s, total_s, nbytes)
            log.info("checkpoint of step %d: blocking %.3f s, total %.3f s", step, blocking_s, total_s)
        except Exception:
            log.exception("checkpoint of step %d failed; it is not committed", step)

    def _commit(self, step: int, directory: Path) -> None:
        # DCP's coordinator (rank 0) writes .metadata after gathering every rank's write results: when its save
        # is done, every shard is on storage.
        files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
        manifest = Manifest(
            v=1,
            step=step,
            time_unix_s=time.time(),
            world_size=self.world_size,
            mesh=self.layout,
            files=[
                ManifestFile(str(p.relative_to(directory).as_posix()), p.stat().st_size, sha256_file(p)) for p in files
            ],
            versions={"torch": str(torch.__version__), "opsd": opsd.__version__},
        )
        tmp = directory / f".{MANIFEST_NAME}.tmp"
        tmp.write_bytes(encode_manifest(manifest))
        os.replace(tmp, directory / MANIFEST_NAME)

    def _apply_retention(self) -> None:
        found = inspect_checkpoints(self.root, verify_checksums=False)
        committed = [c.step for c in found if c.problem is None]
        torn = [c.step for c in found if c.problem is not None]
        for step in select_deletions(committed, torn, self.retention):
            shutil.rmtree(self.root / step_dir_name(step), ignore_errors=True)
            log.info("checkpoint of step %d deleted (retention)", step)

    def wait(self) -> None:
        """Block until the save in flight, if any, is written and committed."""
        with self._lock:
            inflight, self._inflight = self._inflight, None
        if inflight is not None:
            future, committed = inflight
            committed.wait()  # written, and committed on rank 0
            future.result()

    def close(self) -> None:
        self.wait()
        if self._stager is not None:
            self._stager.close()

    # -- load ----------------------------------------------------------------------------------------------------
    def load(self, state: TrainState) -> int | None:
        """Restore the newest committed checkpoint that validates (rank 0 checks sizes and checksums, every rank
        loads the one it chose); the step restored, or None. Skipped checkpoints are in ``resume_problems``."""
        chosen = torch.tensor([-1], dtype=torch.int64)
        if self.rank == 0:
            for candidate in inspect_checkpoints(self.root):
                if candidate.problem is None:
                    chosen[0] = candidate.step
                    break
                message = f"{candidate.path.name}: {candidate.problem}"
                self.resume_problems.append(message)
                log.warning("checkpoint skipped: %s", message)
        dist.broadcast(chosen, src=0, group=self.group)
        step = int(chosen.item())
        if step < 0:
            return None
        directory = self.root / step_dir_name(step)
        manifest = parse_manifest((directory / MANIFEST_NAME).read_bytes())
        same_world = manifest.world_size == self.world_size
        template = state.state_dict(self.rank)
        if not same_world:
            del template[f"rng_rank{self.rank}"]  # another world's ranks: their RNG states do not apply
        dcp_load(template, storage_reader=FileSystemReader(str(directory)), process_group=self.group)
        state.load_state_dict(template, self.rank, restore_rng=same_world)
        log.info("resumed from the checkpoint of step %d (%s)", step, json.dumps(manifest.mesh))
        return step
