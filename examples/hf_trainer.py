"""A tiny Llama trained by Hugging Face's ``transformers.Trainer`` with opsd's callback (docs/integrations.md): DDP
on gloo under torchrun on CPU (``torchrun --nproc-per-node 2 -m examples.hf_trainer --output-dir DIR``), the model
built from a config (no download), synthetic token sequences of a fixed seed.

With ``--resume`` it resumes from the Trainer's newest checkpoint in ``--output-dir``; ``--kill-at-step`` SIGKILLs
rank 0 after that step in a run that did not resume (fault injection); ``--losses-out`` gets each optimizer step's
loss as the Trainer logged it (rank 0). The opsd side is ``trainer_hooks.integrations.hf`` and three lines below."""

from __future__ import annotations

import argparse
import json
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from examples.integration_cli import StepClock, common_options
from trainer_hooks.integrations.hf import OpsdCallback, last_checkpoint
from trainer_hooks.monitor import MonitorConfig
from trainer_hooks.process_exit import run_and_exit

VOCAB = 256


class TokenData(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """``size`` sequences of ``seq_len`` random tokens (seeded): inputs and labels of causal language modelling."""

    def __init__(self, size: int, seq_len: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (size, seq_len), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


class KillAt(TrainerCallback):  # type: ignore[misc]
    """Fault injection: rank 0 is SIGKILLed once step ``step`` is done (and a save due at it written)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        self._maybe(state.global_step)

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        if not control.should_save:
            self._maybe(state.global_step)

    def _maybe(self, step: int) -> None:
        if step == self.step and int(os.environ.get("RANK", "0")) == 0:
            os.kill(os.getpid(), signal.SIGKILL)


class StartStep(TrainerCallback):  # type: ignore[misc]
    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
        self.clock.start()


class EndStep(StartStep):
    def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
        pass

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        self.clock.stop()


def main(argv: Sequence[str] | None = None) -> int:
    p = common_options(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--output-dir", required=True)
    args = p.parse_args(argv)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=args.seq_len,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    training = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=args.save_every,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training, train_dataset=TokenData(256, args.seq_len))
    rank = int(os.environ.get("RANK", "0"))
    jsonl = args.opsd_jsonl.replace("{rank}", str(rank)) if args.opsd_jsonl else None
    clock = StepClock()  # each step's time, for bench.hook_overhead: started before opsd's callback, stopped after
    trainer.add_callback(StartStep(clock))
    if not args.no_opsd:  # the framework alone: the benchmark's other side
        trainer.add_callback(OpsdCallback(trainer, seq_len=args.seq_len, config=MonitorConfig(jsonl_path=jsonl)))
    trainer.add_callback(EndStep(clock))
    resume = last_checkpoint(args.output_dir) if args.resume else None
    if args.kill_at_step and resume is None:  # a relaunch that resumes is not killed again
        trainer.add_callback(KillAt(args.kill_at_step))
    trainer.train(resume_from_checkpoint=resume)
    clock.write(args.step_times_out)
    if args.losses_out and rank == 0:
        losses = {str(e["step"]): e["loss"] for e in trainer.state.log_history if "loss" in e}
        Path(args.losses_out).write_text(json.dumps(losses))
    return 0


if __name__ == "__main__":
    run_and_exit(main)  # the exit code main means, whatever gloo's threads do at exit (docs/crash.md)
