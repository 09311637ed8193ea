"""The nodes' liveness datagrams, taken into memory, and the interval at which agents send their ranks.

An agent that knows the controller's datagram port says it is alive by a signed datagram every second
(``opsd.protocol.liveness``, checked by the API before it gets here) and sends its ranks over HTTP every
``telemetry.interval_s``, which the heartbeat replies carry: at 12,288 nodes, 12,288 datagrams and ~1,400 heartbeats
a second instead of 12,288 heartbeats. The interval is planned (``opsd.policy.telemetry``) every ``PLAN_EVERY_S``
from the nodes heard from within ``HEARD_WITHIN_S``, and at once when the nodes known grow by ``GROWTH``; the compute
samples' slots follow it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial

from opsd.controller.core import ControllerCore
from opsd.controller.live import NodeLive, Window
from opsd.policy.telemetry import plan_telemetry

log = logging.getLogger(__name__)

PLAN_EVERY_S = 5.0
HEARD_WITHIN_S = 60.0
GROWTH = 1.25  # planned again at once when the nodes known grow by this much (a large job starting)


class Liveness:
    def __init__(self, core: ControllerCore) -> None:
        self.core = core

    def alive(self, node: str, seq: int, now_s: float) -> str | None:
        """A node's signed liveness datagram (``seq``: its clock in milliseconds when it sent it): None when taken,
        else why it is refused: ``skew`` (its clock is further than ``liveness_max_skew_s`` from ours) or ``replay``
        (a datagram no newer than the last one taken from the node)."""
        if abs(seq / 1000.0 - now_s) > self.core.config.liveness_max_skew_s:
            return "skew"
        with self.core.lock:
            return self._alive(node, seq, now_s)

    def contacted(self, node: str, now_s: float) -> None:
        """A node's heartbeat arrived and waits to be taken (its first, at the writer's thread): the node counts as
        heard from at once, for the interval planned (``telemetry_interval_s``). When 12,288 nodes start within
        seconds, their first heartbeats wait for seconds; planned from the nodes taken alone, the interval lagged
        the job's size, and the agents answered meanwhile sent their ranks too often, which made the wait longer.
        Called on the API's event loop: left to the lock's next holder when it is held."""
        self.core.defer(partial(self._contacted, node, now_s))

    def _contacted(self, node: str, now_s: float) -> None:
        if node not in self.core.nodes:
            self.core.nodes[node] = NodeLive(node, now_s, Window(self.core.config.history))

    def alive_many(self, taken: Sequence[tuple[str, int, float]], *, wait: bool = True) -> int | None:
        """Datagrams checked and acknowledged by the API's liveness process (``opsd.api.liveness_worker``), each
        ``(node, seq, when it was taken)``, under one hold of the lock; how many were replays (of a node whose
        datagrams that process took before it was started again). ``wait=False`` (the API's event loop): None,
        and nothing taken, when the lock is held elsewhere."""
        if not self.core.lock.acquire(blocking=wait):
            return None
        try:
            self.core.drain()
            return sum(self._alive(node, seq, taken_s) is not None for node, seq, taken_s in taken)
        finally:
            self.core.lock.release()

    def _alive(self, node: str, seq: int, now_s: float) -> str | None:
        live = self.core.nodes.get(node)
        if live is None:
            live = self.core.nodes[node] = NodeLive(node, now_s, Window(self.core.config.history))
        elif seq <= live.liveness_seq:
            return "replay"
        live.alive(seq, now_s)
        self.core.datagrams_total += 1
        return None

    def telemetry_interval_s(self, now_s: float) -> float:
        """The interval agents are asked to send their ranks at, planned again every ``PLAN_EVERY_S`` (the caller
        holds ``lock``)."""
        if now_s >= self.core.telemetry_due_s or len(self.core.nodes) > GROWTH * self.core.telemetry_nodes:
            self.core.telemetry_due_s = now_s + PLAN_EVERY_S
            heard = sum(1 for n in self.core.nodes.values() if now_s - n.last_heartbeat_s <= HEARD_WITHIN_S)
            self.core.telemetry_nodes = max(1, len(self.core.nodes))
            spans = (
                m.live.expected_nodes for m in self.core.memory.values() if m.live is not None and m.settled_s is None
            )
            plan = plan_telemetry(
                nodes=heard,
                expected_nodes=sum(spans),
                current_interval_s=self.core.telemetry.interval_s,
                sample_slot_s=self.core.config.sample_slot_s,
                hang_floor_s=self.core.config.detection.hang_floor_s,
                cadence_lead_s=self.core.config.cadence.lead_s,
                config=self.core.config.telemetry,
            )
            if plan.interval_s != self.core.telemetry.interval_s:
                log.info(
                    "agents send their ranks every %g s (%s); samples compared in slots of %g s",
                    plan.interval_s,
                    plan.reason,
                    plan.sample_slot_s,
                )
            self.core.slots.resize(plan.sample_slot_s, now_s)
            self.core.telemetry = plan
        return self.core.telemetry.interval_s

    def liveness_channels(self, now_s: float) -> dict[str, int]:
        """Nodes heard from within ``HEARD_WITHIN_S`` by the channel of their liveness: ``datagram`` when one came
        within the last few seconds, else ``http``."""
        with self.core.lock:
            nodes = list(self.core.nodes.values())
        recent = [n for n in nodes if now_s - n.last_heartbeat_s <= HEARD_WITHIN_S]
        by_datagram = sum(1 for n in recent if now_s - n.datagram_s <= PLAN_EVERY_S)
        return {"datagram": by_datagram, "http": len(recent) - by_datagram}
