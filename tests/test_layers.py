"""The architecture's rules hold (docs/architecture.md): the import contracts of pyproject.toml (import-linter: the
layers, no cycles, the pure policy, what the agent and the hooks may import, no torch under opsd) and ruff's
banned SDKs, and each fails on a deliberate breach (in a copy of the tree)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import ROOT

PACKAGES = ("opsd", "opsd_agent", "trainer_hooks", "examples", "bench")
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
    "the agent imports the controller": ("opsd_agent/state.py", "import opsd.controller.state", "Layers"),
    "a backend imports the API": ("opsd/backends/fake.py", "import opsd.api.app", "Layers"),
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


def contract_modules(tree: Path) -> set[str]:
    """The modules import-linter's graph holds, built as ``lint-imports`` builds it (grimp, from the contracts'
    root packages)."""
    code = (
        "import grimp, json, sys; sys.path.insert(0, sys.argv[1]);"
        f"print(json.dumps(sorted(grimp.build_graph(*{list(PACKAGES)!r}, cache_dir=None).modules)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tree)], cwd=tree, capture_output=True, text=True, timeout=120, check=True
    )
    return set(json.loads(result.stdout))


def source_modules(tree: Path) -> set[str]:
    """Every Python module of the packages' trees, as a dotted name (a package by its ``__init__``)."""
    found = set()
    for name in PACKAGES:
        for path in (tree / name).rglob("*.py"):
            parts = path.relative_to(tree).with_suffix("").parts
            found.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


def test_the_contracts_see_every_module() -> None:
    """A folder without ``__init__.py`` is invisible to import-linter: no contract would check its imports."""
    missing = source_modules(ROOT) - contract_modules(ROOT)
    assert not missing, f"modules the import contracts never check (a package without __init__.py?): {sorted(missing)}"


def test_a_package_without_init_is_found(tree: Path) -> None:
    (tree / "opsd" / "backends" / "kubernetes" / "__init__.py").unlink()
    missing = source_modules(tree) - contract_modules(tree)
    assert "opsd.backends.kubernetes.backend" in missing
