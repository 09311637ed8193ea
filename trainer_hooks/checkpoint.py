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
versions) atomically, last: the commit marker. A directory without a valid manifest is never loaded. Each shard is
hashed as it is written (the bytes go through SHA-256 on their way to the file), not read back afterwards.

At most one save is in flight. A save due while the previous one is still writing is skipped, so that training
never stalls behind a write: the ranks agree on it (a checkpoint is a collective: one small all-reduce over a
group of its own), it is counted (``skipped``) and reported (``on_skipped``). A save with ``wait=True`` (the last
one of a run) waits for the previous one instead. Saves use their own gloo process group, so background writes
never interleave with the training's collectives.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import opsd
from opsd.checkpoints.layout import CheckpointStore, inspect_checkpoints, sha256_file
from opsd.checkpoints.s3 import S3Options
from opsd.checkpoints.store import open_store
from opsd.errors import ConfigError, OpsError, PermanentError
from opsd.policy.retention import Retention, select_deletions
from opsd.protocol.manifest import Manifest, ManifestFile, encode_manifest, parse_manifest
from opsd.protocol.wire import CHECKPOINT, Activity
from trainer_hooks.checkpoint_io import (
    DCP_METADATA,
    CachedStager,
    StoreWriter,
    VerifyingReader,
    hashes_file,
)
from trainer_hooks.policy_reader import PolicyReader

log = logging.getLogger(__name__)

# Optimizer state keyed by parameter name: pipeline stages hold different parameters, and nested param_groups
# lists would collide across them.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class CheckpointConfig:
    url: str  # file:///path, a plain path, or s3://bucket/prefix
    every_steps: int = 0  # local cadence when no controller policy says otherwise (0: only the policy)
    keep_last: int = 3
    keep_every_steps: int = 0
    async_save: bool = True
    # "thread": DCP writes on a thread of the training process; "process": in a helper process per rank (no GIL
    # shared with training, at the price of one process and a pickled handle per save; see bench.checkpoint_stall)
    async_mode: Literal["thread", "process"] = "thread"
    # a save due while the previous one is still writing: "skip" it (training never waits for a write), or "wait"
    when_busy: Literal["skip", "wait"] = "skip"
    s3: S3Options = field(default_factory=S3Options)

    def __post_init__(self) -> None:
        if not self.url:
            raise ValueError("checkpoint.url must not be empty")
        if "://" in self.url and not self.url.startswith(("file://", "s3://")):
            raise ValueError(f"checkpoint.url {self.url!r}: supported schemes are file://, s3:// (or a plain path)")
        if self.url.startswith("s3://") and not self.url.removeprefix("s3://").split("/")[0]:
            raise ValueError(f"checkpoint.url {self.url!r}: no bucket (expected s3://bucket/prefix)")
        if self.every_steps < 0:
            raise ValueError("checkpoint.every_steps must be >= 0")
        if self.async_mode not in ("thread", "process"):
            raise ValueError(f"checkpoint.async_mode {self.async_mode!r}: expected thread or process")
        if self.when_busy not in ("skip", "wait"):
            raise ValueError(f"checkpoint.when_busy {self.when_busy!r}: expected skip or wait")
        Retention(self.keep_last, self.keep_every_steps)  # validates them


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


def _load_failure(exc: CheckpointException) -> str:
    """The reason a load failed, from the first failing rank's exception (ours say which file and why)."""
    for _, (inner, _trace) in sorted(exc.failures.items()):
        return str(inner) if isinstance(inner, OpsError) else f"{type(inner).__name__}: {inner}"
    return str(exc)


class Checkpointer:
    def __init__(
        self,
        config: CheckpointConfig,
        *,
        world_layout: dict[str, int] | None = None,
        policy: PolicyReader | None = None,
        on_saved: Callable[..., None] | None = None,
        before_commit: Callable[[int], None] | None = None,
        on_skipped: Callable[[int], None] | None = None,
        on_busy: Callable[[Activity], None] | None = None,
    ) -> None:
        """``on_saved(step=, blocking_s=, staging_s=, total_s=, nbytes=)`` runs when a save this rank took part in is
        committed (e.g. ``Monitor.record_checkpoint``); ``on_skipped(step)`` when a save is skipped because the
        previous one is still writing (``Monitor.record_checkpoint_skipped``); ``on_busy("checkpoint")`` when
        training waits for a save and ``on_busy("")`` when it goes on (``Monitor.activity``: no hang meanwhile).
        ``before_commit(step)`` runs on rank 0 just before the manifest is written (fault injection). Collective:
        every rank constructs it (it creates process groups)."""
        self.config = config
        try:
            self.store: CheckpointStore = open_store(config.url, config.s3)
        except OpsError as exc:
            raise ConfigError(str(exc)) from None
        self.layout = dict(world_layout or {})
        self.policy = policy
        self.on_saved = on_saved
        self.on_skipped = on_skipped
        self.on_busy = on_busy
        self.before_commit = before_commit
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.group = dist.new_group(backend="gloo")
        # the decision to skip a save is taken on a group of its own: the writer's thread uses ``group`` meanwhile
        self._decisions = dist.new_group(backend="gloo")
        self.retention = Retention(config.keep_last, config.keep_every_steps)
        self.waits = 0  # saves that waited for the previous one (``wait=True``)
        self.skipped = 0  # saves skipped because the previous one was still writing
        self.resume_problems: list[str] = []
        self._inflight: tuple[Future[Any], threading.Event] | None = None
        # One staging buffer for the run: each save copies into it instead of allocating the state anew.
        self._stager = CachedStager(cache_staged_state_dict=True) if config.async_save else None
        self._lock = threading.Lock()
        self._reader = f"rank{self.rank}-{os.getpid()}"
        self._busy_depth = 0

    # -- cadence -------------------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """Whether to save after ``step``: the controller's cadence from the step it takes effect, else the local
        one."""
        local = self.config.every_steps > 0 and step % self.config.every_steps == 0
        if self.policy is not None:
            return self.policy.current().checkpoint_due(step, local)
        return local

    # -- save ----------------------------------------------------------------------------------------------------
    def required(self, step: int) -> bool:
        """Whether the controller asked for a save after ``step`` itself (a graceful restart): one not to skip."""
        return self.policy is not None and self.policy.current().checkpoint_at_step == step

    def writing(self) -> bool:
        """Whether this rank's previous save is still being written or committed."""
        with self._lock:
            return self._inflight is not None and not self._inflight[1].is_set()

    def save(self, step: int, state: TrainState, *, wait: bool = False) -> float:
        """Save ``state`` as the checkpoint of ``step``; returns the blocking seconds. When the previous save is still
        writing on any rank, the save is skipped (all ranks agree; returns 0.0), unless ``wait`` (a run's last save,
        a save the controller asked for) or the config's ``when_busy`` says so: then it waits for it."""
        start = time.perf_counter()
        busy = torch.tensor(1 if self.writing() else 0, dtype=torch.int32)
        dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=self._decisions)
        if int(busy):
            if not wait and self.config.when_busy == "skip":
                self.skipped += 1
                log.warning("checkpoint of step %d skipped: the previous one is still being written", step)
                if self.on_skipped is not None:
                    self.on_skipped(step)
                return 0.0
            self.waits += 1
        with self._busy():
            return self._save(step, state, start)

    def _save(self, step: int, state: TrainState, start: float) -> float:
        self.wait()
        state_dict = state.state_dict(self.rank)
        writer = StoreWriter(self.store, step, self.rank)
        if self._stager is not None:
            kind = (
                AsyncCheckpointerType.PROCESS if self.config.async_mode == "process" else AsyncCheckpointerType.THREAD
            )
            future = dcp_async_save(
                state_dict,
                storage_writer=writer,
                process_group=self.group,
                async_stager=self._stager,
                async_checkpointer_type=kind,
            )
            blocking_s = time.perf_counter() - start
            staging_s = self._stager.last_staging_s
            assert isinstance(future, Future)
            committed = threading.Event()

            def written(f: Future[Any]) -> None:
                try:
                    self._written(f, step, start, blocking_s, staging_s)
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
            self._written(done, step, start, blocking_s, 0.0)
            blocking_s = time.perf_counter() - start  # a synchronous save blocks until it is committed
        return blocking_s

    def _written(self, future: Future[Any], step: int, start: float, blocking_s: float, staging_s: float) -> None:
        """DCP's save finished on this rank (on the saving thread; every rank gets here, or every rank failed):
        each rank hashes the files it wrote, rank 0 gathers them and commits, everyone reports."""
        try:
            future.result()
            directory = self.store.write_dir(step)
            mine = sorted(
                p.name
                for p in directory.iterdir()
                if p.name.startswith(f"__{self.rank}_") or (self.rank == 0 and p.name == DCP_METADATA)
            )
            hashes = self._hashes(directory)
            files = [self._file(directory, name, hashes) for name in mine]
            gathered: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
            dist.gather_object((files, blocking_s), gathered, dst=0, group=self.group)
            self.store.discard_spool(step, mine)
            if gathered is not None:
                every = sorted((f for part, _ in gathered for f in part), key=lambda f: f.path)
                self._commit(step, every, max(b for _, b in gathered), time.perf_counter() - start)
                self._apply_retention()
            total_s = time.perf_counter() - start
            nbytes = sum(f.bytes for f in files)
            if self.on_saved is not None:
                self.on_saved(step=step, blocking_s=blocking_s, staging_s=staging_s, total_s=total_s, nbytes=nbytes)
            log.info(
                "checkpoint of step %d: blocking %.3f s (staging %.3f s), total %.3f s, %d bytes from this rank",
                step,
                blocking_s,
                staging_s,
                total_s,
                nbytes,
            )
        except (Exception, CheckpointException):
            log.exception("checkpoint of step %d failed; it is not committed", step)

    def _hashes(self, directory: Path) -> dict[str, tuple[str, int]]:
        """The SHA-256 and size of each shard this rank's writer hashed as it wrote (read once, then removed)."""
        path = directory / hashes_file(self.rank)
        try:
            found = {str(k): (str(v[0]), int(v[1])) for k, v in json.loads(path.read_text()).items()}
        except (OSError, ValueError, TypeError, IndexError, AttributeError):
            return {}
        path.unlink(missing_ok=True)
        return found

    def _file(self, directory: Path, name: str, hashes: dict[str, tuple[str, int]]) -> ManifestFile:
        """A file of this rank for the manifest: its hash taken while it was written, if its size still matches;
        else (``.metadata``, written by DCP's coordinator) read back."""
        size = (directory / name).stat().st_size
        digest, written = hashes.get(name, ("", -1))
        return ManifestFile(name, size, digest if written == size else sha256_file(directory / name))

    def _commit(self, step: int, files: list[ManifestFile], blocking_s: float, save_s: float) -> None:
        manifest = Manifest(
            v=1,
            step=step,
            time_unix_s=time.time(),
            world_size=self.world_size,
            mesh=self.layout,
            files=files,
            versions={"torch": str(torch.__version__), "opsd": opsd.__version__},
            blocking_s=blocking_s,
            save_s=save_s,
        )
        if self.before_commit is not None:
            self.before_commit(step)
        self.store.write_manifest(step, encode_manifest(manifest))

    def _apply_retention(self) -> None:
        found = inspect_checkpoints(self.store)
        committed = [c.step for c in found if c.problem is None]
        torn = [c.step for c in found if c.problem is not None]
        for step in select_deletions(committed, torn, self.retention):
            self.store.delete(step)
            log.info("checkpoint of step %d deleted (retention)", step)

    def wait(self) -> None:
        """Block until the save in flight, if any, is written and committed."""
        with self._lock:
            inflight, self._inflight = self._inflight, None
        if inflight is not None and not inflight[1].is_set():
            with self._busy():
                inflight[1].wait()  # written, and committed on rank 0 (failures are logged by _written)

    @contextlib.contextmanager
    def _busy(self) -> Iterator[None]:
        """Training waits for a save: said through ``on_busy`` (nested: said once)."""
        if self.on_busy is None or self._busy_depth:
            self._busy_depth += 1
            try:
                yield
            finally:
                self._busy_depth -= 1
            return
        self._busy_depth = 1
        self.on_busy(CHECKPOINT)
        try:
            yield
        finally:
            self._busy_depth = 0
            self.on_busy("")

    def close(self) -> None:
        self.wait()
        if self._stager is not None:
            self._stager.close()

    # -- load ----------------------------------------------------------------------------------------------------
    def load(self, state: TrainState) -> int | None:
        """Restore the newest committed checkpoint that validates: rank 0 checks manifests and sizes, every rank
        checks the checksum of each file it reads; when a load fails, the next older one is tried. Returns the step
        restored, or None when there is nothing valid to resume from. Each skipped checkpoint is in
        ``resume_problems`` (on every rank) with the reason. Raises ``PermanentError`` when every candidate failed
        while loading (the state may then be partly overwritten: starting afresh from it would be wrong)."""
        listed: list[Any] = [None]
        if self.rank == 0:  # every rank gets the manifests rank 0 validated (no rank reads one on its own)
            listed[0] = [
                (c.step, c.name, c.problem, self.store.read_manifest(c.step) if c.problem is None else None)
                for c in inspect_checkpoints(self.store)
            ]
        dist.broadcast_object_list(listed, src=0, group=self.group)
        partly_loaded = False
        for step, name, problem, manifest in listed[0]:
            if problem is None:
                try:
                    self._load_step(parse_manifest(manifest), state)
                    return int(step)
                except CheckpointException as exc:
                    problem = _load_failure(exc)
                    partly_loaded = True
                finally:
                    self.store.forget_read(step, self._reader)
            message = f"{name}: {problem}"
            self.resume_problems.append(message)
            if self.rank == 0:
                log.warning("checkpoint skipped: %s", message)
        if partly_loaded:  # a failed load may have overwritten some tensors, and no later load overwrote them all
            problems = "; ".join(self.resume_problems)
            raise PermanentError(f"no checkpoint in {self.store.url} could be loaded: {problems}")
        return None

    def _load_step(self, manifest: Manifest, state: TrainState) -> None:
        same_world = manifest.world_size == self.world_size
        template = state.state_dict(self.rank)
        if not same_world:
            del template[f"rng_rank{self.rank}"]  # another world's ranks: their RNG states do not apply
        reader = VerifyingReader(self.store, manifest, self._reader)
        dcp_load(template, storage_reader=reader, process_group=self.group)
        state.load_state_dict(template, self.rank, restore_rng=same_world)
        log.info("resumed from the checkpoint of step %d (%s)", manifest.step, json.dumps(manifest.mesh))
