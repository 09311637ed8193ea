"""opsd inside Hugging Face's ``transformers.Trainer`` (docs/integrations.md): the reference script
``examples/hf_trainer.py`` (a tiny Llama from a config, DDP on gloo, 2 ranks under torchrun) with ``OpsdCallback``.

- every optimizer step is a step report: tokens, step time, MFU, and DDP's gradient all-reduces as ``dp_replicate``;
- the controller's cadence (a policy file: every 3 steps) makes the Trainer save at the policy's steps, besides its
  own (every 4);
- killed at step 7 and started again with ``--resume``, it resumes from the Trainer's own newest checkpoint (step 6,
  the policy's), its reports say so, and its losses from step 7 on are those of the run that was never killed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from opsd.protocol.env import POLICY_FILE_ENV
from tests.integration_runs import (
    STEPS,
    cadence_every_3,
    check_each_steps_report,
    check_killed_and_resumed,
    check_the_agents_series,
    reports,
    run_with_agent,
    under_opsd_run,
)
from tests.launch import ROOT, run_module
from tests.test_docs import blocks

pytestmark = pytest.mark.slow


def train(out: Path, policy: Path, *extra: str, env: dict[str, str] | None = None) -> int:
    argv = ["--output-dir", str(out / "ckpt"), "--steps", str(STEPS), "--opsd-jsonl", str(out / "rank{rank}.jsonl")]
    proc = run_module(
        "examples.hf_trainer", [*argv, *extra], nproc=2, env={POLICY_FILE_ENV: str(policy), **(env or {})}
    )
    assert proc.returncode == 0 or "--kill-at-step" in extra, proc.stderr[-3000:]
    return proc.returncode


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cadence_every_3(tmp_path_factory)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory, policy: Path) -> Path:
    """The run that is never killed, its ranks reporting to a node agent too."""
    out = tmp_path_factory.mktemp("hf-straight")
    extra = ("--losses-out", str(out / "losses.json"), "--step-times-out", str(out / "times.json"))
    run_with_agent(out, lambda env: train(out, policy, *extra, env=env))
    return out


def test_every_optimizer_step_is_reported_with_its_tokens_mfu_and_ddp_all_reduces(straight: Path) -> None:
    for rank in (0, 1):
        check_each_steps_report(straight / f"rank{rank}.jsonl", rank)
    clocked = json.loads((straight / "times.json").read_text())  # bench.hook_overhead's clock, around opsd's callback
    assert len(clocked) == STEPS
    assert all(t > 0 for t in clocked)


def test_the_agent_exports_the_same_series_as_for_the_reference_trainer(straight: Path) -> None:
    check_the_agents_series(straight / "metrics.txt")


def test_the_controllers_cadence_makes_the_trainer_save_at_its_steps(straight: Path) -> None:
    saved = sorted(int(p.name.removeprefix("checkpoint-")) for p in (straight / "ckpt").iterdir())
    assert saved == [3, 4, 6, 8, 9, 12]  # the policy's every 3 and the Trainer's own every 4


def test_killed_and_resumed_from_the_trainers_checkpoint_it_trains_the_same_losses(
    straight: Path, policy: Path, tmp_path: Path
) -> None:
    assert train(tmp_path, policy, "--kill-at-step", "7") != 0
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["checkpoint-3", "checkpoint-4", "checkpoint-6"]
    assert train(tmp_path, policy, "--resume", "--losses-out", str(tmp_path / "losses.json")) == 0
    after = [r for r in reports(tmp_path / "rank0.jsonl") if r.resumed_from_step == 6]
    assert [r.step for r in after] == list(range(7, STEPS + 1))
    expected = json.loads((straight / "losses.json").read_text())
    got = json.loads((tmp_path / "losses.json").read_text())
    assert {s: got[s] for s in map(str, range(7, STEPS + 1))} == {s: expected[s] for s in map(str, range(7, STEPS + 1))}


def test_the_docs_lines_are_those_of_the_tested_script() -> None:
    snippet = blocks("docs/integrations.md", "python")[0]  # the first page's: Hugging Face
    script = (ROOT / "examples" / "hf_trainer.py").read_text()
    for line in snippet.strip().splitlines():
        assert line.strip() in script, line


def test_under_opsd_run_a_killed_rank_is_relaunched_and_resumes_from_the_trainers_checkpoint(
    straight: Path, tmp_path: Path
) -> None:
    """``opsd run`` supervising the Trainer on 2 local nodes: rank 0 SIGKILLed after step 7 (the process exits),
    the controller relaunches the job, and the Trainer resumes from its own newest checkpoint (step 4, its own every
    4: the controller's cadence asks for none this early)."""
    trainer = [sys.executable, "-m", "examples.hf_trainer", "--output-dir", str(tmp_path / "ckpt"), "--resume"]
    trainer += ["--steps", str(STEPS), "--kill-at-step", "7", "--opsd-jsonl", str(tmp_path / "rank{rank}.jsonl")]
    run = under_opsd_run(tmp_path, [*trainer, "--losses-out", str(tmp_path / "losses.json")])
    check_killed_and_resumed(run, straight / "losses.json", killed_at=7, resumed_from=4)
