"""opsd inside Lightning's ``Trainer`` (docs/integrations.md): one callback, ``OpsdCallback``; and in a Fabric loop,
``fabric_monitor``.

    trainer = Trainer(..., callbacks=[OpsdCallback(seq_len=1024, checkpoint_dir="ckpt")])
    trainer.fit(model, data, ckpt_path=last_checkpoint("ckpt"))

- **Each optimizer step is a step report** (``trainer_hooks.monitor``): from the first batch of the step to the batch
  after which ``trainer.global_step`` advanced (gradient accumulation counted once), with this rank's tokens
  (``tokens_per_step``, or the batch's first dimension x ``accumulate_grad_batches`` x ``seq_len``), MFU from
  ``shape`` (``trainer_hooks.flops``; none: no MFU), the loss the step returned, and DDP's gradient all-reduces as the
  ``dp_replicate`` dimension's collectives.
- **The checkpoint cadence** the controller publishes (``trainer_hooks.policy_reader``) makes it save
  ``checkpoint_dir/step=N.ckpt`` with ``trainer.save_checkpoint`` at the policy's steps (every rank calls it, as
  Lightning asks), and ``every_steps`` (0: none) is the job's own cadence until the controller has published one (it
  needs a checkpoint's cost, measured on the first saves); training waits for it, and the rank says so
  (``Monitor.activity``: no hang meanwhile). A run resumes from Lightning's own newest checkpoint there
  (``last_checkpoint``).
- It never raises into training: what fails is counted by the monitor or logged, and training goes on.

A Fabric loop is the user's own: ``fabric_monitor(fabric, model)`` is the ``Monitor`` of its rank (its place in
the job, DDP's gradient all-reduces watched), used as in any loop (``with monitor.step(tokens=...)``), and the
controller's cadence is the policy's (``PolicyReader(policy_source()).current().checkpoint_due(step, local)``,
``local``: the loop's own cadence's answer, until the controller has published one).
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.nn.parallel import DistributedDataParallel

from opsd.protocol.wire import CHECKPOINT
from trainer_hooks.flops import ModelShape
from trainer_hooks.monitor import Monitor, MonitorConfig
from trainer_hooks.policy_reader import PolicyReader, policy_source

log = logging.getLogger(__name__)

_SAVED = re.compile(r"^step=(\d+)\.ckpt$")


def fabric_monitor(
    fabric: Fabric, model: torch.nn.Module, *, shape: ModelShape | None = None, config: MonitorConfig | None = None
) -> Monitor:
    """The ``Monitor`` of this rank of a Fabric loop, ``model`` being what ``fabric.setup`` (or ``setup_module``)
    returned: each rank a data-parallel replica (``dp_replicate``), DDP's gradient all-reduces watched when the
    strategy wrapped it; under
    Fabric's model-parallel strategy, the rank placed on its device mesh and that mesh's collectives labelled by
    dimension (``dp_shard``, ``tp``)."""
    dims = mesh_dims(fabric.strategy)
    coords = {dim: local for dim, _, local in dims} if dims else {"dp_replicate": fabric.global_rank}
    monitor = Monitor(shape, config or MonitorConfig(), coords=coords, batch_shards=fabric.world_size)
    for dim, group, _ in dims:
        monitor.label(group, dim)
    inner = getattr(model, "_forward_module", model)  # a _FabricModule wraps the strategy's module
    if isinstance(inner, DistributedDataParallel):
        monitor.watch_ddp(inner)
    return monitor


def last_checkpoint(checkpoint_dir: str) -> str | None:
    """The newest ``step=N.ckpt`` the callback saved in ``checkpoint_dir`` (None: none): where to resume. A
    distributed checkpoint (a directory: the model-parallel strategy's) counts once its metadata is written, the last
    thing torch's distributed checkpoint writes."""
    try:
        found = [(int(m.group(1)), name) for name in os.listdir(checkpoint_dir) if (m := _SAVED.match(name))]
    except OSError:
        return None
    whole = [(step, name) for step, name in found if _whole(os.path.join(checkpoint_dir, name))]
    return os.path.join(checkpoint_dir, max(whole)[1]) if whole else None


def _whole(path: str) -> bool:
    return not os.path.isdir(path) or os.path.exists(os.path.join(path, ".metadata"))


#: Lightning's model-parallel mesh dimensions, as opsd names them (docs/metrics.md)
MESH_DIMS = {"data_parallel": "dp_shard", "tensor_parallel": "tp"}


def mesh_dims(strategy: object) -> list[tuple[str, Any, int]]:
    """The dimensions of a strategy's device mesh (Lightning's or Fabric's ``ModelParallelStrategy``) with more than
    one rank: (opsd's name, its process group, this rank's place in it); none for another strategy."""
    mesh = getattr(strategy, "device_mesh", None) if hasattr(type(strategy), "device_mesh") else None
    if mesh is None or not mesh.mesh_dim_names:
        return []
    return [
        (MESH_DIMS.get(name, name), mesh[name].get_group(), mesh[name].get_local_rank())
        for name in mesh.mesh_dim_names
        if mesh[name].size() > 1
    ]


class OpsdCallback(Callback):
    """Step reports to the node's agent and the controller's checkpoint cadence, for a Lightning ``Trainer``."""

    def __init__(
        self,
        *,
        seq_len: int,
        checkpoint_dir: str | None = None,
        shape: ModelShape | None = None,
        tokens_per_step: int | None = None,
        config: MonitorConfig | None = None,
        policy: PolicyReader | None = None,
        every_steps: int = 0,
    ) -> None:
        self.seq_len = seq_len
        self.checkpoint_dir = checkpoint_dir
        self.every_steps = every_steps
        self.shape = shape
        self.tokens_per_step = tokens_per_step
        self.config = config or MonitorConfig()
        self.policy = policy if policy is not None else PolicyReader(policy_source())
        self.monitor: Monitor | None = None
        self._from_step: int | None = None  # the global step when the step in progress began
        self._tokens = 0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        rank, world = trainer.global_rank, trainer.world_size
        dims = mesh_dims(trainer.strategy)
        coords = {dim: local for dim, _, local in dims} if dims else {"dp_replicate": rank}
        self.monitor = Monitor(self.shape, self.config, coords=coords, batch_shards=world)
        for dim, group, _ in dims:  # the model-parallel strategy's mesh: its collectives by dimension
            self.monitor.label(group, dim)
        wrapped = trainer.strategy.model
        if isinstance(wrapped, DistributedDataParallel):
            self.monitor.watch_ddp(wrapped)
        if trainer.global_step:
            self.monitor.resume_at(trainer.global_step)  # resumed from the checkpoint of that step

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.monitor is None or self._from_step is not None:
            return  # no monitor, or a batch accumulated into the step in progress
        self._from_step, self._tokens = trainer.global_step, 0
        self.monitor.begin_step()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.monitor is None or self._from_step is None:
            return
        self._tokens += _batch_rows(batch) * self.seq_len
        if trainer.global_step == self._from_step:
            return  # accumulating: the optimizer has not stepped
        self._from_step = None
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self.monitor.record_loss(loss)  # the step's (the last batch's, when it accumulates)
        self.monitor.end_step(self.tokens_per_step if self.tokens_per_step is not None else self._tokens)
        self._save_if_due(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None
        self.policy.close()

    def _save_if_due(self, trainer: Trainer) -> None:
        step = trainer.global_step
        try:
            local = self.every_steps > 0 and step % self.every_steps == 0
            due = self.checkpoint_dir is not None and self.policy.current().checkpoint_due(step, local)
        except Exception as exc:  # the cadence is advice: training goes on without it
            log.warning("opsd: the checkpoint cadence could not be read: %s", exc)
            return
        if not due or self.checkpoint_dir is None or self.monitor is None:
            return
        with self.monitor.busy(CHECKPOINT):  # every rank saves with Lightning (its barriers): no hang meanwhile
            trainer.save_checkpoint(os.path.join(self.checkpoint_dir, f"step={step}.ckpt"))


def _batch_rows(batch: Any) -> int:
    """The sequences in a batch: the first dimension of its first tensor (0: none found)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 0
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, list | tuple):
        return next((n for item in batch if (n := _batch_rows(item))), 0)
    return 0
