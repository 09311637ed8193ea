"""The backends ``opsd serve`` can recover runs with, by name (``controller.backend``): how each one's process is
run, given the server's settings and the backend's own section of the settings (``controller.<name>``, the
entry's ``config``; None for a backend without one). ``opsd run``'s local backend supervises one run of its own and
is its own command.

The built-in backends are here; any other is a plug-in: an installed distribution that names a ``BackendEntry`` in
the entry-point group ``opsd.backends`` (``[project.entry-points."opsd.backends"]``, ``name = "module:ENTRY"``).
What a new backend touches is in docs/architecture.md ("How to add a backend"); ``tests/plugin_backend`` is one,
installed as a plug-in and run by a test.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import cache
from importlib.metadata import entry_points

from opsd.backends.kubernetes.config import KubernetesConfig
from opsd.controller.config import ControllerConfig
from opsd.runtime.config import ServeConfig

log = logging.getLogger(__name__)

#: where an installed distribution names its backend
ENTRY_POINT_GROUP = "opsd.backends"


@dataclass(frozen=True)
class BackendEntry:
    name: str
    description: str  # for the command's help
    serve: Callable[[ServeConfig, object], None]  # runs the controller process until it stops, given its section
    config: type | None = None  # its section of the settings, ``controller.<name>``: a frozen dataclass

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or self.name != self.name.lower():
            raise ValueError(f"a backend's name is a lower-case identifier (its settings' section), not {self.name!r}")


def _none(config: ServeConfig, section: object) -> None:
    from opsd.runtime.server import run_server  # the server's libraries: only when it runs

    run_server(config)


def _kubernetes(config: ServeConfig, kubernetes: object) -> None:
    from opsd.runtime.kubernetes import run_kubernetes  # the kubernetes client: only when chosen

    run_kubernetes(config, kubernetes if isinstance(kubernetes, KubernetesConfig) else KubernetesConfig())


BUILT_IN = (
    BackendEntry("none", "incidents recorded, the cadence published, nothing recovered", _none),
    BackendEntry("kubernetes", "the cluster's nodes and JobSets (docs/kubernetes.md)", _kubernetes, KubernetesConfig),
)
#: the plug-ins that could not be loaded: name -> why (said when one is asked for)
BROKEN: dict[str, str] = {}
#: names a backend's section cannot take: the controller's own keys at the same level (``controller.port``,
#: ``controller.detection``, ...) and the settings' own fields
RESERVED = frozenset(
    {f.name for f in fields(ServeConfig)} | {f.name for f in fields(ControllerConfig)} | {"backend", "sections"}
)


@cache
def backends() -> dict[str, BackendEntry]:
    """Every backend by name: the built-in ones, then the plug-ins installed (one that does not load, is no
    ``BackendEntry``, or takes a built-in's name, is logged and left out)."""
    found = {entry.name: entry for entry in BUILT_IN}
    for point in entry_points(group=ENTRY_POINT_GROUP):
        try:
            entry = point.load()
        except Exception as exc:  # a plug-in's import error must not stop the built-in backends
            BROKEN[point.name] = f"{point.value} does not load: {type(exc).__name__}: {exc}"
            log.error("backend plug-in %s: %s", point.name, BROKEN[point.name])
            continue
        if (
            not isinstance(entry, BackendEntry)
            or entry.name != point.name
            or (entry.name in found or entry.name in RESERVED)
        ):
            BROKEN[point.name] = f"{point.value} is no BackendEntry named {point.name!r} of a name of its own"
            log.error("backend plug-in %s: %s", point.name, BROKEN[point.name])
            continue
        found[entry.name] = entry
    return found


def backend(name: str) -> BackendEntry:
    """The registry's entry for ``name``; ``KeyError`` naming the known ones (and why a plug-in of that name is
    not among them)."""
    known = backends()
    if name in known:
        return known[name]
    why = f" (the plug-in {name!r}: {BROKEN[name]})" if name in BROKEN else ""
    raise KeyError(f"no backend {name!r}; known: {', '.join(known)}{why}")
