"""opsd's own routine operations while a run trains, on the emulated cluster with real ranks and real agents: none of
them may open a failure, quarantine a node or evict a pod, and the run's step keeps advancing; then an XID still
swaps its node for the spare.

What each operation is to the processes here (the controller and the agents are processes, the cluster the emulated
API server): an agent DaemonSet roll (a new image tag, or an agent-only change of the settings; with a checksum per
component a controller-only change does not roll the agents, tests/test_helm_agent.py) stops each node's agent for
longer than ``heartbeat_floor_s`` and starts its new pod at the same address, one node at a time (hostPort forbids a
surge); a controller-only settings change restarts the controller; an ``auth.generation`` rotation restarts the
controller on the new tokens with the old ones as the previous (the Secret's ``<role>-previous``), then rolls the
agents onto the new token; an agent killed comes back after a while (its DaemonSet); the controller killed comes back
(its StatefulSet) on the same state. A certificate renewal restarts nothing (the API reloads it: tests/test_api_tls.py)
and is not played here, where the API speaks plain HTTP.
"""

from __future__ import annotations

import re
import signal
import time
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from opsd.backends.kubernetes.cluster import QUARANTINE_TAINT
from opsd.backends.local.processes import free_port
from opsd.protocol.env import CONTROLLER_TOKEN_ENV
from opsd.protocol.gpu_files import inject_xid
from tests.kube.emulator import KubeEmulator
from tests.kube.training import ControllerProcess
from tests.test_kubernetes_e2e import NODES, RUN, TOKEN, Stack, cluster_with_a_run, controller_settings
from tests.waiting import wait_for

NEW_TOKEN = "e2e-token-generation-2"
STEPS = 100_000  # more than the test lets it train: it is stopped at the end
DOWN_S = 7.0  # an agent's pod replaced: longer than the controller's heartbeat_floor_s (5 s here)
WARNINGS = {"straggler", "agent_down"}


class Operator:
    """The run's controller and what the test counts of the cluster, after each operation."""

    def __init__(self, kube: KubeEmulator, tmp: Path) -> None:
        self.kube = kube
        self.tmp = tmp
        self.port = free_port()
        self.settings = controller_settings(kube, tmp, self.port)
        self.controller = ControllerProcess(self.settings, tmp / "controller")
        self.rows: list[tuple[str, int, int, int, int, int]] = []

    def restart_controller(self, sig: int = signal.SIGTERM, **changes: Any) -> None:
        """The controller's pod replaced (``changes``: its new settings), on the same state."""
        if sig == signal.SIGKILL:
            self.controller.kill()
        else:
            self.controller.proc.send_signal(sig)
            self.controller.proc.wait(timeout=30)
        self.settings = {**self.settings, **changes}
        self.controller = ControllerProcess(self.settings, self.tmp / f"controller-{len(self.rows)}")
        self.controller.wait_healthy()

    def status(self) -> dict[str, Any] | None:
        try:
            found: dict[str, Any] = self.controller.get(f"/v1/runs/{RUN}")
            return found
        except OSError:
            return None

    def refused(self, reason: str) -> float:
        """The rotated controller's refused requests of ``reason`` since it started (its ``/metrics``)."""
        request = urllib.request.Request(
            f"{self.controller.url}/metrics", headers={"Authorization": f"Bearer {self.controller.token}"}
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            text = answer.read().decode()
        found = re.search(rf'^opsd_controller_rejected_requests_total{{reason="{reason}"}} (\S+)$', text, flags=re.M)
        return float(found.group(1)) if found else 0.0

    def step(self) -> int:
        return int((self.status() or {}).get("step") or 0)

    def counts(self) -> tuple[int, int, int]:
        """Failures opened (incidents not warnings), nodes quarantined, pods evicted, so far."""
        incidents = self.controller.get(f"/v1/runs/{RUN}/incidents")
        failures = [i for i in incidents if i["kind"] not in WARNINGS]
        quarantined = [
            n
            for n in NODES
            if QUARANTINE_TAINT
            in {t["key"] for t in (self.kube.get("nodes", None, n) or {}).get("spec", {}).get("taints") or []}
        ]
        evictions = [r for r in self.kube.requests if r.method == "POST" and r.path.endswith("/eviction")]
        return len(failures), len(quarantined), len(evictions)

    def trains_on(self, what: str, before: int) -> int:
        """The step once the run is 5 steps past ``before``, read from whichever controller serves."""
        step: int = wait_for(
            f"the run to train on after {what}", lambda: (s := self.step()) >= before + 5 and s, 120, interval_s=0.2
        )
        return step

    def record(self, what: str, operation: Callable[[], None]) -> None:
        before = self.step()
        operation()
        after = self.trains_on(what, before)
        failures, quarantined, evicted = self.counts()
        self.rows.append((what, before, after, failures, quarantined, evicted))


def roll_agents(stack: Stack, env: dict[str, str] | None = None) -> None:
    """The agent DaemonSet rolled: each node's agent stopped, down ``DOWN_S``, started again; one node at a time."""
    assert stack.agents is not None
    for node in NODES:
        stack.agents.stop(node)
        time.sleep(DOWN_S)
        stack.agents.start(node, env)


@pytest.mark.slow
def test_opsds_own_operations_while_a_run_trains_open_no_failure_and_an_xid_still_swaps(
    kube: KubeEmulator, tmp_path: Path, cleanup: ExitStack
) -> None:
    operator = Operator(kube, tmp_path)
    cleanup.callback(lambda: operator.controller.close())
    stack = cluster_with_a_run(kube, tmp_path, operator.controller.url, network=True, steps=STEPS)
    cleanup.callback(stack.close)
    operator.controller.wait_healthy()
    assert stack.agents is not None
    wait_for("the run training", lambda: operator.step() >= 10, 240, context=stack.logs, interval_s=0.2)

    operator.record("agent DaemonSet rolled (new image, or agent-only settings)", lambda: roll_agents(stack))
    operator.record(
        "controller-only settings change (controller restarted)",
        lambda: operator.restart_controller(tick_interval_s=0.3),
    )

    def rotation() -> None:
        operator.restart_controller(token=NEW_TOKEN, previous_token=TOKEN)
        roll_agents(stack, {CONTROLLER_TOKEN_ENV: NEW_TOKEN})

    operator.record("auth.generation rotation (controller on new + previous tokens, agents rolled onto new)", rotation)
    # while the agents rolled onto the new token, the rotated controller refused none of their heartbeats
    assert operator.refused("auth") == 0

    def agent_killed() -> None:
        assert stack.agents is not None
        stack.agents.stop("node-1", signal.SIGKILL)
        time.sleep(2 * DOWN_S)  # an agent OOM-killed, restarted by its DaemonSet after a back-off
        stack.agents.start("node-1", {CONTROLLER_TOKEN_ENV: NEW_TOKEN})

    operator.record("agent killed (SIGKILL), back 14 s later", agent_killed)
    operator.record("controller killed (SIGKILL), restarted", lambda: operator.restart_controller(signal.SIGKILL))

    print("\noperation | step before | step after | failures | quarantines | evictions")
    for row in operator.rows:
        print(" | ".join(str(v) for v in row))
    assert [row[3:] for row in operator.rows] == [(0, 0, 0)] * len(operator.rows), operator.rows
    assert all(after > before for _, before, after, *_ in operator.rows)

    # and a real failure is still found and acted on: an XID on node-1 swaps it for the spare
    injected = time.monotonic()
    inject_xid(stack.spec.node_dir("node-1") / "gpus", 0, 79)

    def quarantined() -> bool:
        node = kube.get("nodes", None, "node-1") or {}
        return QUARANTINE_TAINT in {t["key"] for t in (node.get("spec") or {}).get("taints") or []}

    wait_for("node-1 quarantined after its XID", quarantined, 60, context=stack.logs, interval_s=0.2)
    found_s = time.monotonic() - injected
    print(f"xid_to_quarantine_s={found_s:.1f}")
    incidents = operator.controller.get(f"/v1/runs/{RUN}/incidents")
    assert [i["kind"] for i in incidents if i["kind"] not in WARNINGS] == ["fatal_xid"]
    assert found_s < 30
