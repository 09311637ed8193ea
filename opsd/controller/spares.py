"""The spares a run may take, and the one it takes: its own spares and the shared pool's (nodes of no run), a
healthy one in the failed node's domain first (``opsd.policy.spares``)."""

from __future__ import annotations

from opsd.controller.core import ControllerCore
from opsd.controller.state import StateStore
from opsd.policy.spares import Spare, select_spare
from opsd.protocol.records import NodeRow
from opsd.protocol.states import NodeRole


def spare_pool(store: StateStore, run: str) -> list[NodeRow]:
    """The spare nodes ``run`` may take: its own, and the shared pool's (nodes of no run)."""
    return [n for n in store.nodes() if n.role == NodeRole.SPARE and n.run in (run, None)]


def choose_spare(core: ControllerCore, run: str, failed_node: str) -> str | None:
    """A healthy spare of ``run``'s pool (its own spares, and the cluster's pool: spares of no run), in the failed
    node's domain first; None when the pool is empty."""
    failed = core.store.node(failed_node)
    domain = failed.domain if failed is not None else ""
    with core.lock:  # a spare whose GPUs reported an event that calls for an action is not healthy
        faulty = {name for name, live in core.nodes.items() if live.events}
    spares = [Spare(n.name, n.name not in faulty, n.domain) for n in spare_pool(core.store, run)]
    chosen = select_spare(spares, domain)
    return None if chosen is None else chosen.node
