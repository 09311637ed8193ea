"""Real training under the emulated cluster: everything below the Kubernetes API is real.

- ``ProcessKubelet``: each pod the JobSet player (``tests.kube.jobset``) starts runs one rank of the reference
  trainer as a process on this machine, its rank the pod's index in the restart attempt, a fresh rendezvous port
  for each attempt, and the environment of the node it was placed on and of its attempt (``OPSD_LAUNCH``, which the
  docs' JobSet takes from the pod's restart-attempt label). The node's: its agent's socket, policy file and Flight
  Recorder directory, what a pod template mounts from the node's ``/run/opsd`` (``agent.transport: hostPath``);
  or, given the agents' ``addresses``, only ``OPSD_AGENT_HOST`` and the agent's ports, what the docs' JobSet gives a
  pod with no host directory (its ``status.hostIP``; the chart's agent on host ports). A pod removed from the API
  server has its process killed, as a kubelet does.
- ``NodeAgents``: one real ``opsd agent`` per node, its GPUs the file source an XID is written into; with
  ``network``, each also listening on a UDP port and an HTTP port of its own (what host ports are to the agents of
  separate nodes: here every node is 127.0.0.1).
- ``ControllerProcess``: ``opsd serve --backend kubernetes`` as a subprocess, on a kubeconfig that points at the
  emulated API server.
- ``LeaderService``: what the chart's Service does for two replicas: every request goes to the replica whose pod is
  labelled ``opsd.io/role=leader`` and not marked not Ready (an HTTP proxy on loopback).

The nodes' directories are laid out as the local backend's (``LocalRunSpec.node_dir``), whose helpers start the
agents and the ranks.
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from opsd.backends.kubernetes.cluster import LEADER, ROLE_LABEL
from opsd.backends.local.processes import free_port, kill_group, rank_env, start_agent, start_rank
from opsd.backends.local.spec import LocalRunSpec
from opsd.protocol.env import (
    AGENT_DATAGRAM_PORT_ENV,
    AGENT_HOST_ENV,
    AGENT_HTTP_PORT_ENV,
    AGENT_SOCKET_ENV,
    FLIGHT_DIR_ENV,
    LAUNCH_ENV,
    POLICY_FILE_ENV,
)
from opsd.protocol.node_agent import AgentAddress
from tests.kube.emulator import KubeEmulator
from tests.kube.jobset import secret_env
from tests.waiting import get_json, wait_for

Json = dict[str, Any]


class ProcessKubelet:
    def __init__(self, spec: LocalRunSpec, world: int, kube: KubeEmulator | None = None) -> None:
        """``kube``: where the Secrets the pods' variables name are read (``secret_env``)."""
        self.spec = spec
        self.world = world
        self.kube = kube
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ports: dict[int, int] = {}  # restart attempt -> its rendezvous port
        self.placed: list[tuple[int, int, str]] = []  # (attempt, rank, node), as started
        self.addresses: dict[str, AgentAddress] = {}  # node -> its agent at the node's address (no host directory)
        self._lock = threading.Lock()

    def start(self, pod: Json, node: str, index: int, attempt: int) -> None:
        name = pod["metadata"]["name"]
        with self._lock:
            if name in self.procs:
                return
            port = self.ports.setdefault(attempt, free_port())
            env = rank_env(self.spec, node, rank=index, local_rank=0, world=self.world, group_rank=index, port=port)
            env[LAUNCH_ENV] = str(attempt)  # the docs' JobSet: the pod's restart-attempt label, by the downward API
            address = self.addresses.get(node)
            if address is not None:  # the docs' JobSet: no host directory, the agent at status.hostIP
                for variable in (AGENT_SOCKET_ENV, POLICY_FILE_ENV, FLIGHT_DIR_ENV):
                    env.pop(variable)
                env[AGENT_HOST_ENV] = address.host
                env[AGENT_DATAGRAM_PORT_ENV] = str(address.datagram_port)
                env[AGENT_HTTP_PORT_ENV] = str(address.http_port)
            if self.kube is not None:
                env.update(secret_env(self.kube, pod["metadata"]["namespace"], pod) or {})
            self.procs[name] = start_rank(self.spec, node, env, f"{name}.log")
            self.placed.append((attempt, index, node))

    def exit_code(self, pod: Json) -> int | None:
        proc = self.procs.get(pod["metadata"]["name"])
        return proc.poll() if proc is not None else None

    def stop(self, pod: Json) -> None:
        proc = self.procs.get(pod["metadata"]["name"])
        if proc is not None and proc.poll() is None:
            kill_group(proc.pid)
            proc.wait(timeout=10)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                kill_group(proc.pid)
                proc.wait(timeout=10)


class NodeAgents:
    """An ``opsd agent`` per node, heartbeating to ``spec.controller_url``."""

    def __init__(
        self, spec: LocalRunSpec, nodes: list[str], *, network: bool = False, env: Mapping[str, str] | None = None
    ) -> None:
        """``env``: every agent's, beside the node's own."""
        self.spec = spec
        self.env = dict(env or {})
        self.addresses: dict[str, AgentAddress] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        for node in nodes:
            if network:
                self.addresses[node] = AgentAddress("127.0.0.1", free_udp_port(), free_port())
            self.start(node)

    def start(self, node: str, env: Mapping[str, str] | None = None) -> None:
        """Start ``node``'s agent (again: at the same address, as a DaemonSet's new pod on that node is)."""
        address = self.addresses.get(node)
        env = {**self.env, **(env or {})}
        if address is None:
            self.procs[node] = start_agent(self.spec, node, (), env)
            return
        spool = self.spec.node_dir(node) / "spool"  # the agent's own directory: no rank writes there
        self.procs[node] = start_agent(
            self.spec,
            node,
            ("--metrics-port", str(address.http_port), "--flight-dir", str(spool)),
            {
                "OPSD_AGENT_DATAGRAM_HOST": address.host,
                "OPSD_AGENT_DATAGRAM_PORT": str(address.datagram_port),
                **(env or {}),
            },
        )

    def stop(self, node: str, sig: int = signal.SIGTERM, grace_s: float = 30.0) -> None:
        """Stop ``node``'s agent as the kubelet stops a pod (SIGTERM, then SIGKILL after the grace period,
        Kubernetes' default 30 s; or SIGKILL at once: killed) and wait for it."""
        proc = self.procs[node]
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            proc.wait(timeout=10)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Until the agent of every node has opened its socket; an agent that exits first fails the wait at once."""
        sockets = {node: self.spec.node_dir(node) / "agent.sock" for node in self.procs}

        def states() -> str:
            return "\n".join(
                f"{node}: socket {'open' if sockets[node].exists() else 'missing'}, exit status {proc.poll()}\n"
                + self.log(node)[-2000:]
                for node, proc in self.procs.items()
            )

        wait_for(
            "socket of each node's agent",
            lambda: all(path.exists() for path in sockets.values()),
            timeout_s,
            alive=lambda: all(proc.poll() is None for proc in self.procs.values()),
            context=states,
            interval_s=0.1,
        )

    def log(self, node: str) -> str:
        path = self.spec.node_dir(node) / "agent.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                kill_group(proc.pid)
            proc.wait(timeout=10)


def free_udp_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def kubeconfig(kube: KubeEmulator, path: Path, token: str = "unchecked") -> Path:
    """A kubeconfig for the emulated API server (plain HTTP; the token is sent, and not checked)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulated", "cluster": {"server": kube.url}}],
        "users": [{"name": "opsd", "user": {"token": token}}],
        "contexts": [{"name": "emulated", "context": {"cluster": "emulated", "user": "opsd"}}],
        "current-context": "emulated",
    }
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


class ControllerProcess:
    """``opsd serve --config FILE`` (the file's ``[controller]`` table from ``settings``), its log in ``log``."""

    def __init__(self, settings: Mapping[str, Any], directory: Path, env: Mapping[str, str] | None = None) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.port = int(settings["port"])
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = str(settings.get("token", ""))  # the reads want it too
        config = directory / "opsd.toml"
        config.write_text(toml_table("controller", settings))
        self.log = directory / "controller.log"
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "opsd", "serve", "--config", str(config), "--log-level", "INFO"],
                env={**os.environ, **(env or {})},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        """Until ``/healthz`` answers; the process exiting first fails the wait at once, with the log's tail."""
        healthz = f"{self.url}/healthz"
        wait_for(
            "answer from the controller",
            lambda: get_json(healthz),
            timeout_s,
            alive=self.proc,
            context=self.tail,
            retry_on=(OSError,),
            interval_s=0.2,
        )

    def get(self, path: str) -> Any:
        return get_json(f"{self.url}{path}", token=self.token, timeout_s=10)

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def kill(self) -> None:
        kill_group(self.proc.pid)
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


def toml_table(name: str, values: Mapping[str, Any]) -> str:
    """``values`` as a TOML table (nested mappings as sub-tables; strings, numbers and booleans)."""
    lines, tables = [f"[{name}]"], []
    for key, value in values.items():
        if isinstance(value, Mapping):
            tables.append(toml_table(f"{name}.{key}", value))
        else:
            lines.append(f"{key} = {json.dumps(value)}")
    return "\n".join([*lines, "", *tables])


class LeaderService:
    """An HTTP proxy on loopback to the controller replica whose pod is labelled leader (``ports``: pod name ->
    the replica's port); 503 while no pod is."""

    def __init__(self, kube: KubeEmulator, namespace: str, ports: Mapping[str, int]) -> None:
        self.kube = kube
        self.namespace = namespace
        self.ports = dict(ports)
        self.routed: dict[str, int] = {}  # pod -> requests sent there
        service = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                service.forward(self)

            def do_POST(self) -> None:
                service.forward(self)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, name="leader-service", daemon=True).start()

    def leader(self) -> str | None:
        """The pod the Service's endpoints hold: labelled leader, and Ready (a dead replica's pod is not)."""
        for pod in self.kube.objects("pods", self.namespace):
            ready = {c.get("type"): c.get("status") for c in (pod.get("status") or {}).get("conditions") or []}
            if (pod["metadata"].get("labels") or {}).get(ROLE_LABEL) == LEADER and ready.get("Ready") != "False":
                return str(pod["metadata"]["name"])
        return None

    def forward(self, request: http.server.BaseHTTPRequestHandler) -> None:
        pod = self.leader()
        body = request.rfile.read(int(request.headers.get("Content-Length") or 0))
        if pod is None or pod not in self.ports:
            request.send_response(503)
            request.send_header("Content-Length", "0")
            request.end_headers()
            return
        self.routed[pod] = self.routed.get(pod, 0) + 1
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "connection")}
        connection = http.client.HTTPConnection("127.0.0.1", self.ports[pod], timeout=10)
        try:
            connection.request(request.command, request.path, body=body or None, headers=headers)
            answer = connection.getresponse()
            data = answer.read()
        except OSError:
            request.send_response(502)
            request.send_header("Content-Length", "0")
            request.end_headers()
            return
        finally:
            connection.close()
        request.send_response(answer.status)
        for key, value in answer.getheaders():
            if key.lower() not in ("content-length", "connection", "transfer-encoding", "date", "server"):
                request.send_header(key, value)
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
