"""What ``helm test`` checks of an install: ``python -m opsd.backends.kubernetes.install_check --namespace NS
--daemonset NAME --controller URL --agent-port PORT``, run by the chart's test pod (docs/kubernetes.md, "Install").

1. The controller answers ``/healthz`` and refuses its API without a token (401).
2. Every node the agent DaemonSet should run on has a Ready agent: its desired and ready counts are compared, again
   every few seconds while agents start (``--wait-s``), and when they still differ the nodes without a Ready agent
   are named, with what their pod says (``Pending``, ``ContainerCreating``, ``CrashLoopBackOff``, no pod). No GPU node
   matched at all is said as such (the agents' node selection, ``gpuNodeTerms``, matches none).
3. Each Ready agent reads its GPUs (its ``/healthz``, at the pod's address): an agent that cannot is named, with the
   ``agent.gpuAccess`` to set.

It prints what it found, and exits 0, or 1 with the reason as its last line; never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from opsd.backends.kubernetes.api import Json, KubeApi, connect
from opsd.errors import OpsError

WAIT_S = 240.0
CHECK_EVERY_S = 5.0


class InstallCheckError(OpsError):
    """What is wrong with the install, said in one line."""


@dataclass(frozen=True)
class Agents:
    desired: int
    ready: int
    missing: tuple[tuple[str, str], ...]  # (node, what its agent's pod says) of the nodes without a Ready agent
    addresses: tuple[tuple[str, str], ...]  # (node, pod IP) of the Ready agents

    @property
    def complete(self) -> bool:
        return self.desired > 0 and self.ready >= self.desired and not self.missing


def pod_node(pod: Json) -> str:
    """The node a DaemonSet's pod is for: where it runs, or the node its required affinity names (the DaemonSet
    controller pins each pod to its node by ``metadata.name``)."""
    spec = pod.get("spec") or {}
    if spec.get("nodeName"):
        return str(spec["nodeName"])
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    for term in required.get("nodeSelectorTerms") or []:
        for field in term.get("matchFields") or []:
            if field.get("key") == "metadata.name" and field.get("values"):
                return str(field["values"][0])
    return "(not yet placed)"


def pod_ready(pod: Json) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def why_not_ready(pod: Json) -> str:
    """What a pod that is not Ready says: a container's waiting reason, else its phase and its scheduling reason."""
    status = pod.get("status") or {}
    for container in status.get("containerStatuses") or []:
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason"):
            return str(waiting["reason"])
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            return f"unschedulable: {condition.get('message') or condition.get('reason') or 'no reason given'}"
    return str(status.get("phase") or "no status")


def agents_of(daemonset: Json, pods: Sequence[Json]) -> Agents:
    """The DaemonSet's counts and its pods, node by node."""
    status = daemonset.get("status") or {}
    desired, ready = int(status.get("desiredNumberScheduled") or 0), int(status.get("numberReady") or 0)
    missing, addresses = [], []
    for pod in sorted(pods, key=pod_node):
        if pod_ready(pod):
            addresses.append((pod_node(pod), str((pod.get("status") or {}).get("podIP") or "")))
        else:
            missing.append((pod_node(pod), why_not_ready(pod)))
    return Agents(desired, ready, tuple(missing), tuple(addresses))


def get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    """The status and body of a GET (an HTTP error's too); ``InstallCheckError`` when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except OSError as exc:
        raise InstallCheckError(f"{url}: no answer ({exc})") from None


def check_controller(url: str, attempts: int, pause_s: float) -> None:
    for attempt in range(1, attempts + 1):
        try:
            status, _ = get(f"{url}/healthz")
            break
        except InstallCheckError as exc:
            if attempt == attempts:
                raise
            print(exc, flush=True)
            time.sleep(pause_s)
    if status != 200:
        raise InstallCheckError(f"controller /healthz: HTTP {status}")
    print("controller /healthz: OK")
    status, _ = get(f"{url}/v1/runs")
    if status != 401:
        raise InstallCheckError(f"controller /v1/runs without a token: HTTP {status}, not 401")
    print("controller API without a token: refused")


def wait_for_agents(
    read: Callable[[], Agents], wait_s: float, every_s: float, clock: Callable[[], float] = time.monotonic
) -> Agents:
    """The agents once every node has a Ready one, reading again every ``every_s`` up to ``wait_s``;
    ``InstallCheckError`` naming the nodes without one."""
    deadline = clock() + wait_s
    while True:
        agents = read()
        if agents.complete:
            print(f"{agents.ready} of {agents.desired} agent(s) Ready")
            return agents
        if clock() >= deadline:
            break
        print(f"{agents.ready} of {agents.desired} agent(s) Ready; waiting", flush=True)
        time.sleep(every_s)
    if agents.desired == 0:
        raise InstallCheckError(
            "no node runs an agent: no node matches the agents' node selection (gpuNodeTerms, gpuNodeSelector)"
        )
    named = ", ".join(f"{node} ({why})" for node, why in agents.missing) or "none named by a pod yet"
    raise InstallCheckError(
        f"{agents.ready} of {agents.desired} agent(s) Ready after {wait_s:.0f} s; nodes without one: {named}"
    )


def check_gpus(agents: Agents, port: int) -> None:
    blind = []
    for node, address in agents.addresses:
        where = f"[{address}]" if ":" in address else address
        status, body = get(f"http://{where}:{port}/healthz")
        if status != 200:
            raise InstallCheckError(f"agent on {node} /healthz: HTTP {status}")
        gpu: dict[str, Any] = (json.loads(body) or {}).get("gpu") or {}
        if gpu.get("available"):
            print(f"agent on {node}: {gpu.get('gpus')} GPU(s) through {gpu.get('source')}")
        else:
            print(f"agent on {node}: no GPU through {gpu.get('source')}: {gpu.get('reason')} ({gpu.get('detail')})")
            blind.append(node)
    if blind:
        raise InstallCheckError(
            f"{len(blind)} of {len(agents.addresses)} agents cannot read their GPUs ({', '.join(blind)}): set "
            "agent.gpuAccess for this platform (docs/kubernetes.md, 'GPU access')"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--controller", required=True, help="the controller's URL")
    parser.add_argument("--daemonset", default="", help="the agents' DaemonSet (none: no agent is checked)")
    parser.add_argument("--agent-port", type=int, default=9464)
    parser.add_argument("--wait-s", type=float, default=WAIT_S, help="how long agents may take to start")
    parser.add_argument("--every-s", type=float, default=CHECK_EVERY_S)
    parser.add_argument("--kubeconfig", default="", help="outside a cluster (default: the in-cluster account)")
    args = parser.parse_args(argv)
    try:
        check_controller(args.controller.rstrip("/"), attempts=30, pause_s=2.0)
        if args.daemonset:
            api = KubeApi(connect(args.kubeconfig))

            def read() -> Agents:
                daemonset = api.daemonset(args.namespace, args.daemonset)
                selector = ",".join(f"{k}={v}" for k, v in daemonset["spec"]["selector"]["matchLabels"].items())
                return agents_of(daemonset, api.pods(args.namespace, selector))

            agents = wait_for_agents(read, args.wait_s, args.every_s)
            check_gpus(agents, args.agent_port)
            print(f"{len(agents.addresses)} agent(s): OK")
    except OpsError as exc:  # InstallCheckError is one
        print(f"opsd install check: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
