"""opsd on Kubernetes end to end, real below the API (tests.kube.training): the reference trainer's ranks as pods of
a JobSet on an emulated cluster, a real agent per node, ``opsd serve --backend kubernetes`` as a subprocess.

- An XID 79 written into node-1's GPU source: its agent reports it, the controller quarantines node-1, promotes the
  spare node-2, evicts the pods; the JobSet restarts onto node-0 and node-2, the ranks resume from the newest
  committed checkpoint, and the run ends with weights bitwise equal to an uninterrupted run's. No node is labelled
  by hand (the spare is designated once; opsd labels the nodes the pods land on), and the ranks reach their agents
  as the docs' JobSet has them, with no host directory: UDP datagrams and HTTP to the agent at their node's
  address.
- Two controller replicas on PostgreSQL with leader election; the leader SIGKILLed just after it evicted the pods
  (before it verified the restart): the other takes the Lease, finishes the recovery, and each step was done once.
"""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from opsd.backends.kubernetes.cluster import (
    CHECKPOINT_URL_ANNOTATION,
    QUARANTINE_TAINT,
    RUN_LABEL,
    SPARE_TAINT,
    rank_key_secret,
)
from opsd.backends.local.processes import free_port
from opsd.backends.local.spec import LocalRunSpec
from opsd.checkpoints.layout import inspect_checkpoints
from opsd.checkpoints.store import open_store
from opsd.protocol.env import RANK_KEY_ENV
from opsd.protocol.gpu_files import inject_xid
from tests.kube.emulator import KubeEmulator
from tests.kube.jobset import JobSetPlayer
from tests.kube.machines import JOBSETS, NAMESPACE, jobset, node
from tests.kube.training import (
    ControllerProcess,
    LeaderService,
    NodeAgents,
    ProcessKubelet,
    kubeconfig,
)
from tests.launch import run_module
from tests.waiting import get_json, wait_for

pytestmark = pytest.mark.slow

RUN = "llm"
STEPS = 100  # ~70 steps (7-10 s) left after the XID: under load the pods must be evicted before the run ends
TAKEOVER_STEPS = 160  # the takeover's run: ~137 steps (~15 s) left after the XID, rather than ~70
NODES = ["node-0", "node-1", "node-2"]  # node-2: the spare
CONTROLLER_NAMESPACE = "opsd"
TOKEN = "e2e-token"  # the controller's API token, which the agents send (the chart's Secret)
RANK_SECRET = "e2e-ranks-secret"  # the runs' keys derive from it (the chart's Secret too)


def trainer_args(ckpt_url: str, losses: Path, steps: int = STEPS) -> list[str]:
    return [
        *("--mesh", "dp_shard=2", "--steps", str(steps), "--opsd-monitor"),
        *("--ckpt-dir", ckpt_url, "--ckpt-every", "10", "--resume", "--losses-out", str(losses)),
    ]


@dataclass
class Stack:
    kube: KubeEmulator
    tmp: Path
    ckpt_url: str
    losses: Path
    spec: LocalRunSpec
    kubelet: ProcessKubelet
    player: JobSetPlayer
    steps: int = STEPS  # the run's
    agents: NodeAgents | None = None
    controllers: dict[str, ControllerProcess] = field(default_factory=dict)
    service: LeaderService | None = None

    def logs(self) -> str:
        parts = [f"--- {name} ---\n{c.tail()}" for name, c in self.controllers.items()]
        for path in sorted((self.tmp / "nodes").rglob("*.log")):
            parts.append(f"--- {path.name} ---\n{path.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)

    def close(self) -> None:
        self.player.stop()
        self.kubelet.close()
        for controller in self.controllers.values():
            controller.close()
        if self.agents is not None:
            self.agents.close()
        if self.service is not None:
            self.service.close()


def cluster_with_a_run(
    kube: KubeEmulator,
    tmp: Path,
    controller_url: str,
    *,
    network: bool = False,
    steps: int = STEPS,
    rank_secret: str = "",
) -> Stack:
    """Two GPU nodes nobody labelled, a spare, and the run's JobSet of ``steps`` steps (its pods, one rank each,
    start at once); ``network``: the ranks reach their agents at their node's address (no host directory);
    ``rank_secret``: the agents require the run's key, which the pods take from the Secret the controller makes
    (docs/kubernetes.md, "The run's key")."""
    kube.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    kube.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": CONTROLLER_NAMESPACE}})
    kube.put(node("node-0"))
    kube.put(node("node-1"))
    kube.put(node("node-2", spare=True))
    ckpt_url = f"file://{tmp / 'ckpt'}"
    losses = tmp / "losses.json"
    spec = LocalRunSpec(
        run=RUN,
        command=(sys.executable, "-m", "examples.train", *trainer_args(ckpt_url, losses, steps)),
        nodes=2,
        gpus_per_node=1,
        spares=1,
        workdir=str(tmp / "nodes"),
        controller_url=f"{controller_url}/v1/heartbeat",
        token=TOKEN,
    )
    kubelet = ProcessKubelet(spec, world=2, kube=kube)
    stack = Stack(kube, tmp, ckpt_url, losses, spec, kubelet, JobSetPlayer(kube, kubelet), steps)
    required = {"OPSD_AGENT_RANK_SECRET": rank_secret, "OPSD_AGENT_RANK_AUTH": "required"} if rank_secret else {}
    stack.agents = NodeAgents(spec, NODES, network=network, env=required)
    kubelet.addresses = stack.agents.addresses
    stack.agents.wait_ready()
    key = {"name": RANK_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": rank_key_secret(RUN), "key": "key"}}}
    container = {"name": "trainer", "image": "trainer:1", "env": [key]} if rank_secret else None
    kube.put(jobset(RUN, 2, annotations={CHECKPOINT_URL_ANNOTATION: ckpt_url}, grace_s=5, container=container))
    stack.player.start()
    return stack


def controller_settings(kube: KubeEmulator, tmp: Path, port: int, **kubernetes: Any) -> dict[str, Any]:
    tmp.mkdir(parents=True, exist_ok=True)
    return {
        "port": port,
        # any free ports: two replicas on one host (a cluster gives each pod its own address, and its Service sends
        # every port to the leader); each reply names the ports of the replica that answered it
        "liveness_port": 0,
        "heartbeat_port": 0,
        "state_dir": str(tmp / "state"),
        "token": TOKEN,
        "tick_interval_s": 0.25,
        "backend": "kubernetes",
        "detection": {"heartbeat_floor_s": 5.0, "hang_floor_s": 30.0},
        "kubernetes": {
            "kubeconfig": str(kubeconfig(kube, tmp / "kubeconfig")),
            "namespace": CONTROLLER_NAMESPACE,
            "resync_interval_s": 0.5,
            **kubernetes,
        },
    }


def inject_after_a_checkpoint(stack: Stack, status: Any, after_step: int = 20) -> int:
    """Once a checkpoint of ``after_step`` or later is committed and training is 3 steps past it: an XID 79 on
    node-1's GPU 0. The step it came at."""
    store = open_store(stack.ckpt_url)

    def ready() -> int | None:
        # any such checkpoint: the newest one would be chased (the reported step lags the ranks by a heartbeat, and
        # by then the next checkpoint can be committed, again and again to the run's end)
        committed = [c.step for c in inspect_checkpoints(store) if c.problem is None and c.step >= after_step]
        step = int((status() or {}).get("step") or 0)
        assert step < stack.steps, f"the run reached step {step} of {stack.steps} before the XID was injected"
        return step if committed and step >= min(committed) + 3 else None

    step: int = wait_for("a committed checkpoint", ready, 240, context=stack.logs, interval_s=0.2)
    inject_xid(stack.spec.node_dir("node-1") / "gpus", 0, 79)
    return step


def finished(stack: Stack, status: Any, steps: int | None = None) -> dict[str, Any]:
    """The run's status once its JobSet completed, and (``steps``) once its final step is that: the ranks' last
    reports come with their agent's next heartbeat, which may reach the controller after the JobSet completed."""

    def done() -> dict[str, Any] | None:
        found = stack.kube.get(JOBSETS, NAMESPACE, RUN) or {}
        conditions = {c["type"] for c in (found.get("status") or {}).get("conditions") or []}
        now = status() or {}
        ended = "Completed" in conditions and now.get("state") == "completed"
        return now if ended and (steps is None or now.get("step") == steps) else None

    result: dict[str, Any] = wait_for("the run's completion", done, 300, context=stack.logs, interval_s=0.2)
    return result


def closed_incidents(stack: Stack, get: Callable[[str], Any]) -> list[dict[str, Any]]:
    """The run's incidents once its swap's is closed: a run whose pods ran to their end before the relaunch step
    confirmed the restart completes first, and its incident is closed by the pass after that step."""

    def closed() -> list[dict[str, Any]] | None:
        try:
            found: list[dict[str, Any]] = get(f"/v1/runs/{RUN}/incidents")
        except OSError:
            return None
        failures = [i for i in found if i["kind"] != "straggler"]
        return found if failures and all(i["state"] != "open" for i in failures) else None

    result: list[dict[str, Any]] = wait_for("the incident closed", closed, 60, context=stack.logs)
    return result


def check_the_swap(stack: Stack, incidents: list[dict[str, Any]], actions: list[dict[str, Any]]) -> None:
    """The cluster and the controller's record after one XID swap of node-1 for node-2."""
    kube = stack.kube
    (incident,) = [i for i in incidents if i["kind"] != "straggler"]
    assert (incident["kind"], incident["state"], incident["spare"]) == ("fatal_xid", "recovered", "node-2")
    assert [(a["kind"], a["state"]) for a in actions] == [
        ("cordon", "done"),
        ("take_spare", "done"),
        ("stop", "done"),
        ("launch", "done"),
    ]
    failed, spare = kube.get("nodes", None, "node-1"), kube.get("nodes", None, "node-2")
    assert failed is not None
    assert spare is not None
    assert failed["spec"]["unschedulable"] is True
    assert QUARANTINE_TAINT in {t["key"] for t in failed["spec"]["taints"]}
    assert SPARE_TAINT not in {t["key"] for t in spare["spec"].get("taints") or []}
    assert spare["metadata"]["labels"][RUN_LABEL] == RUN
    found = kube.get(JOBSETS, NAMESPACE, RUN)
    assert found is not None
    assert found["status"]["restarts"] == 1
    assert stack.player.restarts == 1
    assert sorted(p for p in stack.kubelet.placed if p[0] == 1) == [(1, 0, "node-0"), (1, 1, "node-2")]
    reasons = {e["reason"] for e in kube.objects("events") if e["involvedObject"]["kind"] == "JobSet"}
    assert {"OpsdQuarantine", "OpsdPromoteSpare", "OpsdEvict", "OpsdRestarted"} <= reasons, reasons
    evictions = [r for r in kube.requests if r.method == "POST" and r.path.endswith("/eviction")]
    assert len(evictions) == 2, [r.path for r in evictions]  # each pod of the first attempt, once


def check_bitwise(stack: Stack, incidents: list[dict[str, Any]]) -> None:
    """The resumed run's final weights and optimizer state are those of the same job never interrupted."""
    interrupted = json.loads(stack.losses.read_text())
    (incident,) = [i for i in incidents if i["kind"] != "straggler"]
    assert interrupted["resumed_from_step"] >= 20
    assert incident["resumed_from_step"] == interrupted["resumed_from_step"]  # from the ranks' reports
    straight = stack.tmp / "straight.json"
    proc = run_module(
        "examples.train", trainer_args(f"file://{stack.tmp / 'straight'}", straight, stack.steps), nproc=2
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(straight.read_text())["state_hashes"] == interrupted["state_hashes"]


def test_an_xid_swaps_the_node_for_a_spare_and_the_run_resumes_bit_for_bit(
    kube: KubeEmulator, tmp_path: Path, cleanup: ExitStack
) -> None:
    port = free_port()
    controller = ControllerProcess(
        controller_settings(kube, tmp_path, port, rank_secret=RANK_SECRET), tmp_path / "controller"
    )
    stack = cluster_with_a_run(kube, tmp_path, controller.url, network=True, rank_secret=RANK_SECRET)
    cleanup.callback(stack.close)
    stack.controllers["opsd"] = controller
    controller.wait_healthy()

    def status() -> Any:
        try:
            return controller.get(f"/v1/runs/{RUN}")
        except OSError:
            return None

    injected_at = inject_after_a_checkpoint(stack, status)
    run = finished(stack, status, STEPS)

    assert run["step"] == STEPS
    assert injected_at < STEPS
    incidents = closed_incidents(stack, controller.get)
    check_the_swap(stack, incidents, controller.get(f"/v1/runs/{RUN}/actions"))
    check_bitwise(stack, incidents)
    # the ranks' reports came as datagrams to the agents' UDP ports: no rank was told of a socket; each signed with
    # the run's key from the Secret the controller made beside the JobSet (the agents refuse any other)
    assert stack.agents is not None
    for name in ("node-0", "node-2"):
        with urllib.request.urlopen(f"{stack.agents.addresses[name].http_base}/metrics", timeout=5) as r:
            metrics = r.read().decode()
        received = re.search(rf'^opsd_agent_datagrams_total{{node="{name}"}} (\S+)$', metrics, flags=re.M)
        assert received is not None
        assert float(received.group(1)) > 0
        refused = re.findall(
            rf'^opsd_agent_datagrams_rejected_total{{node="{name}",reason="(\w+)"}} (\S+)$', metrics, re.M
        )
        assert {reason: float(n) for reason, n in refused if float(n)} == {}
    made = kube.get("secrets", NAMESPACE, rank_key_secret(RUN))
    assert made is not None
    assert made["metadata"]["ownerReferences"][0]["kind"] == "JobSet"  # deleted with it


@pytest.fixture
def database(postgres_url: str) -> Iterator[str]:
    """A fresh PostgreSQL database for the two replicas."""
    name = f"ha_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sa.text(f"CREATE DATABASE {name}"))
    yield postgres_url.rsplit("/", 1)[0] + f"/{name}"
    with admin.connect() as c:
        c.execute(sa.text(f"DROP DATABASE {name} WITH (FORCE)"))
    admin.dispose()


def controller_pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": CONTROLLER_NAMESPACE, "labels": {"app.kubernetes.io/name": "opsd"}},
        "spec": {"containers": [{"name": "controller", "image": "opsd"}]},
    }


def test_the_standby_takes_the_lease_and_finishes_a_recovery_its_leader_died_in(
    kube: KubeEmulator, tmp_path: Path, database: str, cleanup: ExitStack
) -> None:
    ports = {"opsd-a": free_port(), "opsd-b": free_port()}
    kube.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": CONTROLLER_NAMESPACE}})
    for pod in ports:
        kube.put(controller_pod(pod))
    service = LeaderService(kube, CONTROLLER_NAMESPACE, ports)
    election = {"leader_election": True, "lease_duration_s": 4, "renew_deadline_s": 3, "retry_period_s": 1}
    replicas = {}
    for pod, port in ports.items():
        settings = controller_settings(kube, tmp_path / pod, port, pod_name=pod, **election)
        settings["state_url"] = database
        replicas[pod] = ControllerProcess(settings, tmp_path / pod)
    # long enough that the run cannot end before the dead leader's recovery relaunches it: with 60 steps, under a
    # loaded machine the ranks ran to their end after the XID before their pods were evicted, and the recovery then
    # waited for a relaunch that had nothing to relaunch
    stack = cluster_with_a_run(kube, tmp_path, service.url, steps=TAKEOVER_STEPS)
    stack.service = service
    stack.controllers.update(replicas)
    cleanup.callback(stack.close)
    first = wait_for("a leader", service.leader, 60, context=stack.logs, interval_s=0.2)

    def status() -> Any:
        try:
            return get_json(f"{service.url}/v1/runs/{RUN}", token=TOKEN, timeout_s=10)
        except OSError:
            return None

    inject_after_a_checkpoint(stack, status)

    def evicted() -> bool:
        return any(e["reason"] == "OpsdEvict" for e in kube.objects("events"))

    wait_for("the leader's evictions", evicted, 120, context=stack.logs, interval_s=0.2)
    replicas[first].kill()  # SIGKILL: mid-recovery, its restart not yet verified
    dead = kube.get("pods", CONTROLLER_NAMESPACE, first)
    assert dead is not None
    kube.put({**dead, "status": {"conditions": [{"type": "Ready", "status": "False"}]}})  # as its kubelet tells
    killed_at = time.monotonic()
    successor = next(p for p in ports if p != first)
    wait_for("the new leader", lambda: service.leader() == successor, 60, context=stack.logs, interval_s=0.2)
    took_over_s = time.monotonic() - killed_at

    finished(stack, status)

    incidents = closed_incidents(stack, replicas[successor].get)
    actions = replicas[successor].get(f"/v1/runs/{RUN}/actions")
    check_the_swap(stack, incidents, actions)
    assert len({a["request_id"] for a in actions}) == len(actions)
    assert took_over_s < 4 + 3 + 10  # the lease runs out, the standby's next try takes it
    assert "goes on under this leader" in replicas[successor].tail(200_000)
    check_bitwise(stack, incidents)
