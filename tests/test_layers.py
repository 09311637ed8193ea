"""The architecture's rules hold (docs/architecture.md): the import contracts of pyproject.toml (import-linter: the
layers, no cycles, the pure policy, what the agent and the hooks may import, no torch under opsd) and ruff's
banned SDKs, and each fails on a deliberate breach (in a copy of the tree)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import ROOT

PACKAGES = ("opsd", "agent", "trainer_hooks", "examples", "bench")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
RUFF = Path(sys.executable).with_name("ruff")


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=tree, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the packages and of pyproject.toml (the contracts), to break on purpose."""
    for name in PACKAGES:
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_contracts_hold() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


BREACHES = {
    # name: (file, line added, the contract that must break)
    "torch in the policy": ("opsd/policy/cadence.py", "import torch", "opsd.policy is pure"),
    "the controller imports the API": ("opsd/controller/core.py", "import opsd.api.app", "Layers"),
    "the agent imports the controller": ("agent/state.py", "import opsd.controller.state", "Layers"),
    "the hooks import the post-mortem": ("trainer_hooks/sinks.py", "import opsd.postmortem.build", "The trainer hooks"),
    "a deferred import closes a cycle": (
        "opsd/controller/core.py",
        "def _cycle() -> None:\n    import opsd.controller.recovery",
        "No import cycles",
    ),
    "the reference trainer under opsd": ("opsd/analysis/planner.py", "import examples.mesh", "Nothing under opsd"),
}


@pytest.mark.parametrize(("path", "line", "contract"), BREACHES.values(), ids=BREACHES.keys())
def test_a_breach_breaks_its_contract(tree: Path, path: str, line: str, contract: str) -> None:
    with (tree / path).open("a") as f:
        f.write(f"\n\n{line}\n")
    result = lint_imports(tree)
    assert result.returncode != 0, result.stdout
    broken = [row for row in result.stdout.splitlines() if row.endswith("BROKEN")]
    assert any(contract in row for row in broken), result.stdout


def test_an_sdk_outside_its_adapter_is_refused(tree: Path) -> None:
    probe = tree / "opsd" / "controller" / "probe.py"
    probe.write_text("import boto3\nimport kubernetes.client\nimport torch.distributed\n")
    result = subprocess.run(
        [str(RUFF), "check", "--no-cache", "--select", "TID251", str(probe)],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert [line.split()[1] for line in result.stdout.splitlines() if line.startswith("TID251")] == [
        "`boto3`",
        "`kubernetes`",
        "`torch`",
    ]
