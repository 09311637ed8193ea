"""What ``helm test`` checks (opsd.backends.kubernetes.install_check): the agents' DaemonSet's desired and ready
counts, waited for while agents start, the nodes without a Ready agent named; on the emulated API server, with the
controller's and the agents' HTTP endpoints stood in for by a small server here."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from opsd.backends.kubernetes.install_check import (
    Agents,
    InstallCheckError,
    agents_of,
    main,
    wait_for_agents,
)
from tests.kube.emulator import KubeEmulator
from tests.kube.training import kubeconfig

Json = dict[str, Any]
LABELS = {"app.kubernetes.io/name": "opsd", "app.kubernetes.io/component": "agent"}


def agent_pod(
    node: str, *, ready: bool = True, placed: bool = True, waiting: str = "", unschedulable: str = ""
) -> Json:
    """A pod of the DaemonSet for ``node``, as the DaemonSet controller makes it (pinned by ``matchFields``)."""
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    if unschedulable:
        conditions.append({"type": "PodScheduled", "status": "False", "message": unschedulable})
    status: Json = {"phase": "Running" if ready else "Pending", "conditions": conditions, "podIP": "127.0.0.1"}
    if waiting:
        status["containerStatuses"] = [{"name": "agent", "state": {"waiting": {"reason": waiting}}}]
    pin = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
    spec: Json = {
        "containers": [{"name": "agent", "image": "opsd"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [pin]}}},
    }
    if placed:
        spec["nodeName"] = node
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"opsd-agent-{node}", "namespace": "opsd", "labels": LABELS},
        "spec": spec,
        "status": status,
    }


def daemonset(desired: int, ready: int) -> Json:
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "opsd-agent", "namespace": "opsd"},
        "spec": {"selector": {"matchLabels": LABELS}, "template": {"metadata": {"labels": LABELS}, "spec": {}}},
        "status": {"desiredNumberScheduled": desired, "numberReady": ready},
    }


CASES = {
    "every agent ready": ([agent_pod("gpu-a"), agent_pod("gpu-b")], (2, 2), True, ()),
    "one crashing": (
        [agent_pod("gpu-a"), agent_pod("gpu-b", ready=False, waiting="CrashLoopBackOff")],
        (2, 1),
        False,
        (("gpu-b", "CrashLoopBackOff"),),
    ),
    "one not placed, named by its pin": (
        [
            agent_pod("gpu-a"),
            agent_pod("gpu-c", ready=False, placed=False, unschedulable="0/3 nodes: Insufficient cpu"),
        ],
        (2, 1),
        False,
        (("gpu-c", "unschedulable: 0/3 nodes: Insufficient cpu"),),
    ),
    "one starting": (
        [agent_pod("gpu-a", ready=False, waiting="ContainerCreating")],
        (1, 0),
        False,
        (("gpu-a", "ContainerCreating"),),
    ),
    "no GPU node matched": ([], (0, 0), False, ()),
}


@pytest.mark.parametrize(("pods", "counts", "complete", "missing"), list(CASES.values()), ids=list(CASES))
def test_the_agents_node_by_node(
    pods: list[Json], counts: tuple[int, int], complete: bool, missing: tuple[tuple[str, str], ...]
) -> None:
    agents = agents_of(daemonset(*counts), pods)
    assert (agents.complete, agents.missing) == (complete, missing)


def test_agents_that_start_while_it_waits_pass_and_those_that_never_do_are_named() -> None:
    now = [0.0]
    reads = iter([Agents(3, 1, (("gpu-b", "ContainerCreating"), ("gpu-c", "Pending")), ()), Agents(3, 3, (), ())])
    assert wait_for_agents(lambda: next(reads), 60, 0, clock=lambda: now[0]).ready == 3
    stuck = Agents(3, 2, (("gpu-c", "CrashLoopBackOff"),), ())

    def later() -> Agents:
        now[0] += 10
        return stuck

    with pytest.raises(InstallCheckError, match=r"2 of 3 agent\(s\) Ready after 30 s; nodes without one: gpu-c"):
        wait_for_agents(later, 30, 0, clock=lambda: now[0])
    with pytest.raises(InstallCheckError, match="no node matches the agents' node selection"):
        wait_for_agents(lambda: Agents(0, 0, (), ()), 0, 0)


@pytest.fixture
def endpoints() -> Iterator[tuple[str, int]]:
    """The controller's /healthz and API, and an agent's /healthz, on one local server: (its URL, its port)."""

    class Stand(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/healthz":
                body = {"status": "ok", "node": "n", "gpu": {"available": True, "gpus": 8, "source": "nvml"}}
                status = 200
            else:
                body, status = {"detail": "a valid bearer token is required"}, 401
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Stand)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_the_check_on_a_cluster_names_the_node_whose_agent_is_not_ready(
    kube: KubeEmulator, tmp_path: Path, endpoints: tuple[str, int], capsys: pytest.CaptureFixture[str]
) -> None:
    url, port = endpoints
    kube.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "opsd"}})
    kube.put(daemonset(3, 2))
    for pod in (agent_pod("gpu-a"), agent_pod("gpu-b"), agent_pod("gpu-c", ready=False, waiting="ImagePullBackOff")):
        kube.put(pod)
    args = ["--namespace", "opsd", "--controller", url, "--daemonset", "opsd-agent", "--agent-port", str(port)]
    args += ["--kubeconfig", str(kubeconfig(kube, tmp_path / "kubeconfig")), "--wait-s", "0.2", "--every-s", "0.05"]
    assert main(args) == 1
    assert "2 of 3 agent(s) Ready after 0 s; nodes without one: gpu-c (ImagePullBackOff)" in capsys.readouterr().err
    kube.put(agent_pod("gpu-c"))
    kube.put(daemonset(3, 3))
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "3 of 3 agent(s) Ready" in out
    assert "agent on gpu-c: 8 GPU(s) through nvml" in out
