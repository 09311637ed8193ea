"""opsd inside Hugging Face's ``transformers.Trainer`` (docs/integrations.md), through its callbacks:

    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.add_callback(OpsdCallback(trainer, seq_len=512))
    trainer.train(resume_from_checkpoint=last_checkpoint(args.output_dir))

Each optimizer step is one step report to the node's agent (``trainer_hooks.monitor``): step time, tokens/s, MFU
(the model's shape counted from the model itself, ``shape_from_module``), and the time in DDP's gradient all-reduces
as the ``dp_replicate`` dimension's (the Trainer's DDP wrapper, watched at the start of training). The checkpoint
cadence the controller publishes (``trainer_hooks.policy_reader``) asks the Trainer for a save
(``control.should_save``) at the policy's steps, besides its own ``save_steps``; a run resumes from the Trainer's own
newest checkpoint (``last_checkpoint``). The callback never raises into training: what fails is logged and
counted by the monitor.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from opsd.protocol.wire import CHECKPOINT
from trainer_hooks.flops import ModelShape, shape_from_module
from trainer_hooks.monitor import Monitor, MonitorConfig
from trainer_hooks.policy_reader import PolicyReader, policy_source

log = logging.getLogger(__name__)


def model_shape(model: nn.Module, seq_len: int) -> ModelShape:
    """The FLOPs shape of a decoder-only ``transformers`` model, from its config (layers, heads) and its matmuls."""
    config: Any = getattr(model, "config", None)
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    layers = int(config.num_hidden_layers)
    return shape_from_module(model, n_layers=layers, n_heads=heads, head_dim=head_dim, seq_len=seq_len)


def last_checkpoint(output_dir: str) -> str | None:
    """The Trainer's newest checkpoint in ``output_dir`` (None: none, or no such directory): where to resume."""
    return get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None


class OpsdCallback(TrainerCallback):  # type: ignore[misc]
    """The monitor around each optimizer step and the controller's checkpoint cadence, for ``trainer``.

    ``seq_len``: the tokens of one sequence (the batches' length); ``tokens_per_step``: this rank's tokens in one
    optimizer step (default: ``per_device_train_batch_size x gradient_accumulation_steps x seq_len``); ``shape``:
    the model's FLOPs shape (default: ``model_shape``)."""

    def __init__(
        self,
        trainer: Trainer,
        *,
        seq_len: int,
        config: MonitorConfig | None = None,
        policy: PolicyReader | None = None,
        shape: ModelShape | None = None,
        tokens_per_step: int | None = None,
    ) -> None:
        self.trainer = trainer
        self.seq_len = seq_len
        self.config = config or MonitorConfig()
        self.policy = policy if policy is not None else PolicyReader(policy_source())
        self.shape = shape
        self.tokens_per_step = tokens_per_step
        self.monitor: Monitor | None = None

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        model: Any = kwargs.get("model") or self.trainer.model
        try:
            shape = self.shape or model_shape(model, self.seq_len)
        except Exception as exc:  # MFU is then not reported; everything else is
            log.warning("opsd: the model's shape could not be counted (no MFU): %s", exc)
            shape = None
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.monitor = Monitor(shape, self.config, coords={"dp_replicate": rank}, batch_shards=world)
        wrapped = self.trainer.model_wrapped
        if isinstance(wrapped, DistributedDataParallel):
            self.monitor.watch_ddp(wrapped)
        if state.global_step:
            self.monitor.resume_at(state.global_step)  # resumed from the Trainer's checkpoint of that step

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.monitor is not None:
            self.monitor.begin_step()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        if self.monitor is not None:
            tokens = self.tokens_per_step
            if tokens is None:
                tokens = args.per_device_train_batch_size * args.gradient_accumulation_steps * self.seq_len
            self.monitor.end_step(tokens)
        try:
            if self.policy.current().checkpoint_due(state.global_step):
                control.should_save = True
        except Exception as exc:  # the cadence is advice: training goes on with the Trainer's own
            log.warning("opsd: the checkpoint cadence could not be read: %s", exc)
        if control.should_save and self.monitor is not None:
            self.monitor.activity(CHECKPOINT)  # the Trainer saves next, synchronously: no hang until ``on_save``
        return control

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.monitor is not None:
            self.monitor.activity("")

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None
        self.policy.close()
