"""Silent agents: the backend's view of a silent node (the second witness where its ranks have no peer), and the
nodes whose agent is down while their ranks train (``opsd.policy.detection``'s ``AgentDown``): kept for the
status and ``opsd_run_agents_down``, and recorded once per silence as an ``agent_down`` warning, never recovered
from.
"""

from __future__ import annotations

import logging

from opsd.controller.incidents import agent_down_key
from opsd.controller.needs import SilenceNeeds
from opsd.controller.port import NodeWitness
from opsd.controller.rows import RunRow
from opsd.errors import OpsError
from opsd.policy.detection import AgentDown
from opsd.protocol.states import IncidentKind, IncidentState

log = logging.getLogger(__name__)


class Silence:
    def __init__(self, core: SilenceNeeds) -> None:
        self.core = core

    def backend_node_ready(self, nodes: list[str]) -> dict[str, bool]:
        """The backend's view of each silent node, where it has one (``NodeWitness``): asked outside the lock."""
        witness = self.core.backend if isinstance(self.core.backend, NodeWitness) else None
        if witness is None or not nodes:
            return {}
        out = {}
        for node in nodes:
            try:
                up = witness.node_ready(node)
            except OpsError as exc:
                log.warning("the backend could not say whether %s is up: %s", node, exc)
                continue
            if up is not None:
                out[node] = up
        return out

    def _agents_down(self, run: RunRow, down: list[AgentDown], now_s: float) -> None:
        """Keep the nodes whose agent is silent while their ranks train (the status, ``opsd_run_agents_down``), and
        record each silence once, as a warning: an operations event, nothing to recover."""
        with self.core.lock:
            memory = self.core.remember(run.id)
            before = {d.node for d in memory.agents_down}
            memory.agents_down = down
            heard = {d.node: self.core.nodes[d.node].last_heartbeat_s for d in down if d.node in self.core.nodes}
        for d in down:
            if d.node in before:
                continue
            log.warning("run %s: the agent of %s is down while its ranks train: %s", run.id, d.node, d.detail)
            incident, _ = self.core.store.open_incident(
                key=agent_down_key(run.id, run.generation, d.node, heard.get(d.node, now_s)),
                run=run.id,
                kind=IncidentKind.AGENT_DOWN,
                node=d.node,
                rank=None,
                detail=d.detail,
                failed_s=now_s,
                detected_s=now_s,
            )
            self.core.store.update_incident(incident, state=IncidentState.WARNED)  # a warning: nothing to recover
        for node in before - {d.node for d in down}:
            log.info("run %s: the agent of %s is heard from again (or its node was judged)", run.id, node)
