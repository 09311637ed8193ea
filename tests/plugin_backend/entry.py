"""The ledger backend's entry in opsd's registry (``opsd.runtime.registry``): named in the entry-point group
``opsd.backends`` of the distribution that installs it, ``ledger = "tests.plugin_backend.entry:ENTRY"``.

Its controller process (``opsd serve --backend ledger``): the server's, with this backend; before it serves, the
runs the ledger lists and the store does not have yet are recorded (their nodes and spares) and launched, as a
scheduler's jobs are found by a cluster's backend."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from opsd.controller.controller import Controller
from opsd.controller.rows import RunSpec
from opsd.protocol.states import NodeRole
from opsd.runtime.config import ServeConfig
from opsd.runtime.registry import BackendEntry
from opsd.runtime.server import run_server
from tests.plugin_backend.backend import LedgerBackend, LedgerPart, read_ledger
from tests.plugin_backend.config import LedgerConfig

log = logging.getLogger(__name__)


def take_up(controller: Controller, backend: LedgerBackend, now_s: float) -> None:
    """The ledger's runs that the store does not have: recorded, with their nodes and spares, and launched."""
    for run, listed in read_ledger(backend.path)["runs"].items():
        part = LedgerPart(listed["nodes"], listed["spares"])
        if not controller.store.create_run(run, RunSpec(backend=backend.name).with_own(part), now_s):
            continue
        for node in part.nodes:
            controller.store.upsert_node(node, now_s, run=run, role=NodeRole.ACTIVE, domain="ledger")
        for node in part.spares:
            controller.store.upsert_node(node, now_s, run=run, role=NodeRole.SPARE, domain="ledger")
        controller.recovery.launch_first(run, now_s)
        log.info("run %s: taken from the ledger %s and launched", run, backend.path)


def serve(config: ServeConfig, section: object) -> None:
    backend = LedgerBackend(section if isinstance(section, LedgerConfig) else LedgerConfig())
    if not Path(backend.path).exists():
        raise SystemExit(f"no ledger at {backend.path}")
    run_server(config, backend, before=lambda controller: take_up(controller, backend, time.time()))


ENTRY = BackendEntry("ledger", "machines kept in a JSON ledger (a test plug-in)", serve, LedgerConfig)

#: a plug-in that names itself after the controller's own settings (``controller.detection``): refused by the registry
DETECTION = BackendEntry("detection", "a backend whose name is taken (a test)", serve, LedgerConfig)
