"""The wheel installs cleanly: its top-level names are opsd's own (no ``examples``, ``bench`` or bare ``agent`` in a
user's site-packages), and each role's extra installs from it into a clean environment and runs its entry point
without the other roles' libraries: the agent's without the controller's (kubernetes, boto3, matplotlib, the Grafana
SDK) or torch, the trainer's without the controller's. pip installs from the same pins as ``make``
(constraints.txt), from its cache or the index; the three environments are made side by side."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.launch import ROOT

pytestmark = pytest.mark.slow

SOURCES = ("pyproject.toml", "README.md", "opsd", "opsd_agent", "trainer_hooks")
CONTROLLER_ONLY = ("kubernetes", "boto3", "matplotlib", "grafana_foundation_sdk", "fastapi", "sqlalchemy", "uvicorn")
#: role -> (modules it must have, modules it must not)
ROLES = {
    "agent": (("opsd_agent.daemon", "pynvml"), (*CONTROLLER_ONLY, "torch")),
    "controller": (("opsd.runtime.server", "opsd.backends.kubernetes.api", "opsd_agent.daemon"), ("torch",)),
    "trainer": (("trainer_hooks.monitor", "trainer_hooks.checkpoint", "torch", "torchft"), CONTROLLER_ONLY[2:]),
}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from a copy of the sources (a build in the checkout would leave ``build/`` there)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in SOURCES:
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)], check=True)
    (built,) = out.glob("opsd-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """role -> the python of a clean environment with ``opsd[role]`` from the wheel (installed side by side)."""
    root = tmp_path_factory.mktemp("envs")
    pythons, installs = {}, {}
    for role in ROLES:
        subprocess.run([sys.executable, "-m", "venv", str(root / role)], check=True)
        pythons[role] = root / role / "bin" / "python"
        command = [str(pythons[role]), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        command += ["-c", str(ROOT / "constraints.txt"), f"{wheel}[{role}]"]
        installs[role] = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for role, proc in installs.items():
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"pip install opsd[{role}]: {out.decode(errors='replace')[-3000:]}"
    return pythons


def test_the_wheels_top_level_names_are_opsds_own(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        top = {name.split("/")[0] for name in z.namelist()}
    assert top == {"opsd", "opsd_agent", "trainer_hooks", wheel.name.split("-py3")[0] + ".dist-info"}


@pytest.mark.parametrize("role", ROLES)
def test_each_role_installs_alone_and_has_its_libraries_and_no_other_roles(
    role: str, installed: dict[str, Path]
) -> None:
    python = installed[role]
    having, not_having = ROLES[role]
    probe = (
        "import importlib, importlib.util, sys\n"
        f"for m in {having!r}: importlib.import_module(m)\n"
        f"present = [m for m in {not_having!r} if importlib.util.find_spec(m) is not None]\n"
        "sys.exit(f'installed: {present}' if present else 0)\n"
    )
    proc = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, cwd=python.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_agent_runs_from_its_install_and_the_controller_commands_say_what_is_missing(
    installed: dict[str, Path], tmp_path: Path
) -> None:
    opsd = installed["agent"].parent / "opsd"
    assert subprocess.run([str(opsd), "agent", "--help"], capture_output=True).returncode == 0
    agent = subprocess.Popen(
        [str(opsd), "agent", "--socket", str(tmp_path / "a.sock"), "--metrics-port", "0", "--gpu-source", "none"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert agent.stdout is not None
        lines = [agent.stdout.readline() for _ in range(4)]  # 3 log lines, then what it serves
        assert lines[-1].startswith("opsd agent: datagrams on"), lines
    finally:
        agent.terminate()
        agent.wait(timeout=30)
    serve = subprocess.run([str(opsd), "serve"], capture_output=True, text=True, cwd=tmp_path)
    assert serve.returncode == 2
    assert "pip install 'opsd[controller]'" in serve.stderr
    controller = installed["controller"].parent / "opsd"
    assert subprocess.run([str(controller), "serve", "--help"], capture_output=True).returncode == 0
