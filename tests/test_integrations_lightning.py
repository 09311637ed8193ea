"""opsd inside Lightning (docs/integrations.md): the reference model trained by Lightning's ``Trainer`` with
``OpsdCallback`` (``examples/lightning_trainer.py``) and in a Fabric loop with ``fabric_monitor``
(``examples/fabric_loop.py``), DDP on gloo, 2 ranks under torchrun; each example goes through every test:

- every optimizer step is a step report: tokens, step time, MFU, the loss, and DDP's gradient all-reduces as
  ``dp_replicate``; the agent exports them as for the reference trainer;
- the controller's cadence (a policy file: every 3 steps) makes every rank save a Lightning checkpoint at its steps;
- killed at step 7 and started again with ``--resume``, it resumes from the newest of them (step 6), its reports say
  so, and its losses from step 7 on are those of the run that was never killed.

Each also under its framework's model-parallel strategy (``ModelParallelStrategy``, Lightning's and Fabric's: FSDP2
over the ranks): its collectives as ``dp_shard``'s, its distributed checkpoints at the cadence's steps, killed and
resumed with the same losses.
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


EXAMPLES = ("examples.lightning_trainer", "examples.fabric_loop")


def train(example: str, out: Path, policy: Path, *extra: str, env: dict[str, str] | None = None) -> int:
    argv = ["--checkpoint-dir", str(out / "ckpt"), "--steps", str(STEPS), "--opsd-jsonl", str(out / "rank{rank}.jsonl")]
    proc = run_module(example, [*argv, *extra], nproc=2, env={POLICY_FILE_ENV: str(policy), **(env or {})})
    assert proc.returncode == 0 or "--kill-at-step" in extra, proc.stderr[-3000:]
    return proc.returncode


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cadence_every_3(tmp_path_factory)


@pytest.fixture(scope="module", params=EXAMPLES)
def example(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory, policy: Path, example: str) -> Path:
    """The run that is never killed, its ranks reporting to a node agent too."""
    out = tmp_path_factory.mktemp("lightning-straight")
    extra = ("--losses-out", str(out / "losses.json"), "--step-times-out", str(out / "times.json"))
    run_with_agent(out, lambda env: train(example, out, policy, *extra, env=env))
    return out


def test_every_optimizer_step_is_reported_with_its_tokens_mfu_loss_and_ddp_all_reduces(straight: Path) -> None:
    losses = json.loads((straight / "losses.json").read_text())
    for rank in (0, 1):
        steps = check_each_steps_report(straight / f"rank{rank}.jsonl", rank)
        assert all(r.loss is not None and r.loss > 0 for r in steps)
        if rank == 0:  # the loss each step returned, as the module kept it
            assert {str(r.step): r.loss for r in steps} == pytest.approx(losses)
            clocked = json.loads((straight / "times.json").read_text())  # bench.hook_overhead's clock
            assert len(clocked) == STEPS
            assert all(t > 0 for t in clocked)


def test_the_agent_exports_the_same_series_as_for_the_reference_trainer(straight: Path) -> None:
    check_the_agents_series(straight / "metrics.txt")


def test_the_controllers_cadence_makes_every_rank_save_at_its_steps(straight: Path) -> None:
    saved = sorted(int(p.name.removeprefix("step=").removesuffix(".ckpt")) for p in (straight / "ckpt").iterdir())
    assert saved == [3, 6, 9, 12]


def test_killed_and_resumed_from_lightnings_checkpoint_it_trains_the_same_losses(
    straight: Path, policy: Path, example: str, tmp_path: Path
) -> None:
    assert train(example, tmp_path, policy, "--kill-at-step", "7") != 0
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step=3.ckpt", "step=6.ckpt"]
    assert train(example, tmp_path, policy, "--resume", "--losses-out", str(tmp_path / "losses.json")) == 0
    after = [r for r in reports(tmp_path / "rank0.jsonl") if r.resumed_from_step == 6]
    assert [r.step for r in after] == list(range(7, STEPS + 1))
    expected = json.loads((straight / "losses.json").read_text())
    got = json.loads((tmp_path / "losses.json").read_text())
    assert got == {s: expected[s] for s in map(str, range(7, STEPS + 1))}  # bit for bit


@pytest.fixture(scope="module")
def model_parallel(tmp_path_factory: pytest.TempPathFactory, policy: Path, example: str) -> Path:
    """The example under its framework's model-parallel strategy (FSDP2 over the 2 ranks), never killed."""
    out = tmp_path_factory.mktemp("lightning-model-parallel")
    extra = ("--strategy", "model_parallel", "--losses-out", str(out / "losses.json"))
    assert train(example, out, policy, *extra) == 0
    return out


def test_under_the_model_parallel_strategy_each_step_reports_its_sharded_collectives_as_dp_shard(
    model_parallel: Path,
) -> None:
    """FSDP2 shards the model over the strategy's ``data_parallel`` dimension: opsd names it ``dp_shard``, and its
    all-gathers and reduce-scatters are the step's collectives there."""
    for rank in (0, 1):
        steps = reports(model_parallel / f"rank{rank}.jsonl")
        assert [r.step for r in steps] == list(range(1, STEPS + 1))
        for r in steps:
            assert (r.world_size, r.tokens, r.coords) == (2, 4 * 32, {"dp_shard": rank})
            assert r.step_s > 0
            assert 0 < r.mfu_ratio < 1
            assert {(c.dimension, c.op) for c in r.comms} == {
                ("dp_shard", "all_gather"),
                ("dp_shard", "reduce_scatter"),
            }
    saved = sorted(p.name for p in (model_parallel / "ckpt").iterdir())
    assert saved == ["step=12.ckpt", "step=3.ckpt", "step=6.ckpt", "step=9.ckpt"]  # the cadence's, sharded (DCP)
    assert all((model_parallel / "ckpt" / name / ".metadata").exists() for name in saved)


def test_under_the_model_parallel_strategy_killed_and_resumed_it_trains_the_same_losses(
    model_parallel: Path, policy: Path, tmp_path: Path, example: str
) -> None:
    strategy = ("--strategy", "model_parallel")
    assert train(example, tmp_path, policy, *strategy, "--kill-at-step", "7") != 0
    assert train(example, tmp_path, policy, *strategy, "--resume", "--losses-out", str(tmp_path / "losses.json")) == 0
    after = [r for r in reports(tmp_path / "rank0.jsonl") if r.resumed_from_step == 6]
    assert [r.step for r in after] == list(range(7, STEPS + 1))
    expected = json.loads((model_parallel / "losses.json").read_text())
    got = json.loads((tmp_path / "losses.json").read_text())
    assert got == {s: expected[s] for s in map(str, range(7, STEPS + 1))}  # bit for bit


@pytest.mark.parametrize(("block", "script"), [(1, "lightning_trainer.py"), (2, "fabric_loop.py")])
def test_the_docs_lines_are_those_of_the_tested_scripts(block: int, script: str) -> None:
    snippet = blocks("docs/integrations.md", "python")[block]  # after Hugging Face's: the Trainer's, Fabric's
    text = (ROOT / "examples" / script).read_text()
    for line in snippet.strip().splitlines():
        assert line.strip() in text, line


def test_under_opsd_run_a_killed_rank_is_relaunched_and_resumes_from_lightnings_checkpoint(
    straight: Path, example: str, tmp_path: Path
) -> None:
    """``opsd run`` supervising the loop on 2 local nodes: rank 0 SIGKILLed after step 7 (the process exits), the
    controller relaunches the job, and it resumes from its newest checkpoint (step 4: the job's own every 4, the
    controller having published no cadence this early)."""
    trainer = [sys.executable, "-m", example, "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume"]
    trainer += ["--steps", str(STEPS), "--kill-at-step", "7", "--opsd-jsonl", str(tmp_path / "rank{rank}.jsonl")]
    run = under_opsd_run(tmp_path, [*trainer, "--losses-out", str(tmp_path / "losses.json")])
    check_killed_and_resumed(run, straight / "losses.json", killed_at=7, resumed_from=4)
