"""The local backend's guards (its runs end to end are in tests/test_demo.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from opsd.controller import Controller
from opsd.errors import PermanentError
from opsd.local import LocalBackend, LocalRunSpec
from opsd.store import Store


def test_a_run_name_is_not_taken_twice(tmp_path: Path) -> None:
    controller = Controller(Store.open(f"sqlite:///{tmp_path / 'opsd.db'}"))
    controller.store.create_run("job", {}, now_s=1.0)
    controller.store.update_run("job", 2.0, state="completed")
    backend = LocalBackend(LocalRunSpec(run="job", command=("true",), workdir=str(tmp_path / "runs")))
    with pytest.raises(PermanentError, match=r"run 'job' exists already in this state store \(completed\)"):
        backend.start(controller, now_s=3.0)
    assert backend.agents == {}  # nothing was started


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"command": ()}, "a trainer command is needed"),
        ({"nodes": 0}, "--nodes and --gpus-per-node must be >= 1"),
        ({"run": "a/b"}, "without '/'"),
    ],
    ids=["no-command", "no-nodes", "slash"],
)
def test_spec_validates_itself(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LocalRunSpec(**{"run": "r", "command": ("true",), **kwargs})  # type: ignore[arg-type]
