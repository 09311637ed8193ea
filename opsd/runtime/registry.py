"""The backends ``opsd serve`` can recover runs with, by name (``controller.backend``): how each one's process is
run, given the server's settings and the backend's own section of the settings (``controller.<name>``; None for a
backend without one). ``opsd run``'s local backend supervises one run of its own and is its own command.

A new backend is its adapter under ``opsd/backends/<name>/`` (the port's steps, on ``opsd.controller.steps``), its
configuration (a frozen dataclass, the settings' ``controller.<name>`` section), one entry here, and its entry in the
contract suite (docs/architecture.md, "How to add a backend")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opsd.runtime.config import ServeConfig


@dataclass(frozen=True)
class BackendEntry:
    name: str
    description: str  # for the command's help
    serve: Callable[[ServeConfig, Any], None]  # runs the controller process until it stops


def _none(config: ServeConfig, section: Any) -> None:
    from opsd.runtime.server import run_server  # the server's libraries: only when it runs

    run_server(config, section)


def _kubernetes(config: ServeConfig, kubernetes: Any) -> None:
    from opsd.runtime.kubernetes import run_kubernetes  # the kubernetes client: only when chosen

    run_kubernetes(config, kubernetes)


BACKENDS: dict[str, BackendEntry] = {
    entry.name: entry
    for entry in (
        BackendEntry("none", "incidents recorded, the cadence published, nothing recovered", _none),
        BackendEntry("kubernetes", "the cluster's nodes and JobSets (docs/kubernetes.md)", _kubernetes),
    )
}


def backend(name: str) -> BackendEntry:
    """The registry's entry for ``name``; ``KeyError`` naming the known ones."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise KeyError(f"no backend {name!r}; known: {', '.join(BACKENDS)}") from None
