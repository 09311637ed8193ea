"""A backend that is not opsd's, installed as a plug-in (``tests.plugin_backend``: its machines a JSON ledger):
found in the entry-point group ``opsd.backends`` of an installed distribution, its section of the settings read
from the file and the environment, and a run of its recovered by ``opsd serve --backend ledger``. It touches only
what docs/architecture.md lists (its package, its entry point, its ``Machines`` in the contract suite:
``tests/test_backend_contract.py`` runs it there).

"Installed" is a distribution's metadata on the path, as pip writes it (``<name>.dist-info/METADATA`` and
``entry_points.txt``): what ``importlib.metadata`` reads, for a wheel installed into site-packages too."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from opsd.backends.local.processes import free_port
from opsd.cli import settings
from opsd.cli.app import app
from opsd.errors import ConfigError
from opsd.runtime import registry
from tests.plugin_backend.backend import LedgerPart, new_ledger, read_ledger
from tests.plugin_backend.config import LedgerConfig
from tests.waiting import get_json, wait_for

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "plugin-operator-token"


def install(site: Path, name: str, points: dict[str, str]) -> Path:
    """A distribution ``name`` whose entry points in ``opsd.backends`` are ``points`` (backend -> object), as pip
    leaves it in ``site``."""
    dist = site / f"{name}-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    lines = "".join(f"{backend} = {target}\n" for backend, target in points.items())
    (dist / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\n{lines}")
    return site


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The ledger plug-in installed in this process (and a broken one, and one that takes a built-in's name)."""
    site = install(
        tmp_path / "site",
        "opsd_ledger",
        {
            "ledger": "tests.plugin_backend.entry:ENTRY",
            "broken": "tests.plugin_backend.missing:ENTRY",
            "kubernetes": "tests.plugin_backend.entry:ENTRY",
            "detection": "tests.plugin_backend.entry:DETECTION",
        },
    )
    monkeypatch.syspath_prepend(str(site))
    registry.backends.cache_clear()
    registry.BROKEN.clear()
    try:
        yield site
    finally:
        registry.backends.cache_clear()
        registry.BROKEN.clear()


def test_an_installed_plug_in_is_a_backend_with_its_own_section_of_the_settings(
    installed: Path, tmp_path: Path
) -> None:
    known = registry.backends()
    assert list(known) == ["none", "kubernetes", "ledger"]  # the built-in kubernetes is not replaced
    assert known["ledger"].config is LedgerConfig
    assert "controller.ledger.path" in {k.path for k in settings.keys("controller")}

    path = tmp_path / "opsd.toml"
    path.write_text('[controller]\nbackend = "ledger"\n[controller.ledger]\npath = "/var/ledger.json"\n')
    loaded = settings.load("controller", str(path), env={"OPSD_CONTROLLER_LEDGER_GPUS_PER_NODE": "4"})
    assert loaded.backend == "ledger"
    assert loaded.section("ledger") == LedgerConfig(path="/var/ledger.json", gpus_per_node=4)
    with pytest.raises(ConfigError, match=re.escape("controller.ledger.gpus_per_node must be >= 1")):
        settings.load("controller", str(path), env={"OPSD_CONTROLLER_LEDGER_GPUS_PER_NODE": "0"})


def test_a_plug_in_that_does_not_load_is_left_out_and_named_when_asked_for(installed: Path) -> None:
    assert "broken" not in registry.backends()
    with pytest.raises(
        KeyError, match=re.escape("the plug-in 'broken': tests.plugin_backend.missing:ENTRY does not load")
    ):
        registry.backend("broken")
    with pytest.raises(KeyError, match="the plug-in 'detection'"):  # controller.detection is the controller's own
        registry.backend("detection")
    with pytest.raises(KeyError, match="no backend 'slurm'; known: none, kubernetes, ledger"):
        registry.backend("slurm")


def test_without_the_plug_in_its_backend_is_unknown() -> None:
    assert "ledger" not in registry.backends()
    with pytest.raises(ConfigError, match=re.escape("controller.backend must be one of none, kubernetes")):
        settings.load("controller", None, env={"OPSD_CONTROLLER_BACKEND": "ledger"})


@pytest.mark.slow
def test_opsd_serve_recovers_a_run_of_the_plug_ins_machines(tmp_path: Path) -> None:
    """``opsd serve --backend ledger``: the ledger's run recorded and launched; an operator's XID drill on node-1 is
    recovered on the ledger's machines (node-1 quarantined, the spare promoted, the ranks stopped and launched
    again on node-0 and the spare), as on any backend."""
    site = install(tmp_path / "site", "opsd_ledger", {"ledger": "tests.plugin_backend.entry:ENTRY"})
    ledger = tmp_path / "ledger.json"
    new_ledger(ledger, {"job": LedgerPart(["node-0", "node-1"], ["node-2"])})
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
        "OPSD_CONTROLLER_LEDGER_PATH": str(ledger),
        "OPSD_CONTROLLER_LIVENESS_PORT": "0",
        "OPSD_CONTROLLER_HEARTBEAT_PORT": "",
    }
    args = ["--backend", "ledger", "--port", str(port), "--state-dir", str(tmp_path / "state"), "--token", TOKEN]
    log = (tmp_path / "serve.log").open("w")
    serve = subprocess.Popen([sys.executable, "-m", "opsd", "serve", *args], env=env, stderr=log, stdout=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for("the controller's API", lambda: get_json(f"{url}/healthz"), 30, alive=serve, retry_on=(OSError,))
        launched = wait_for("the first launch", lambda: read_ledger(ledger)["launches"].get("job"), 10)
        assert launched == {"generation": 1, "ranks": {"0": "node-0", "1": "node-1"}}

        drill = CliRunner().invoke(app, ["drill", "xid", "job", "--node", "node-1", "--url", url, "--token", TOKEN])
        assert drill.exit_code == 0, drill.output

        def relaunched() -> dict[str, Any] | None:
            launch: dict[str, Any] = read_ledger(ledger)["launches"]["job"]
            return launch if launch["generation"] == 2 else None

        relaunch = wait_for("the relaunch", relaunched, 30, alive=serve)
        machines = read_ledger(ledger)
    finally:
        serve.terminate()
        serve.wait(timeout=30)
        log.close()
    assert relaunch["ranks"] == {"0": "node-0", "1": "node-2"}
    assert machines["nodes"] == {"node-0": "ready", "node-1": "quarantined", "node-2": "ready"}
    steps = [step for _, step in machines["effects"]]
    assert steps == ["relaunch", "quarantine_node", "promote_spare", "stop_ranks", "relaunch"]
    said = (tmp_path / "serve.log").read_text()
    assert serve.returncode in (0, -signal.SIGTERM), said[-3000:]  # uvicorn stops, then raises the signal it caught
    assert "Traceback" not in said, said[-3000:]
