"""The local backend: each "node" is a group of rank processes on this machine plus its own agent; spares are
extra node slots with an agent and no ranks. The embedded default, for laptops, CI and the demo.

Ranks get torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``) plus ``OPSD_RUN``, ``OPSD_NODE``, ``OPSD_AGENT_SOCKET`` and ``OPSD_POLICY_FILE``;
each launch (a generation) gets a fresh rendezvous port. The trainer command must resume from its newest
checkpoint by itself (the reference trainer: ``--ckpt-dir URL --resume``).

A recovery is a list of actions, each recorded in the state store under a request id before it is carried out
and marked done after: ``stop`` (every rank of the launch, SIGKILL to its process group), ``cordon`` (when the
failure asks for a swap), ``take_spare``, ``launch``. Each is idempotent, so a recovery cut short is taken up
where it stopped. Fault injection (``inject``) is real: an XID appended to a node's GPU source, SIGKILL, SIGSTOP
(a hang), or a SIGSTOP/SIGCONT duty cycle that slows a rank down by a factor.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.gpu import GpuSample, inject_xid, write_samples
from opsd.controller import Controller
from opsd.errors import OpsError, PermanentError
from opsd.policy.detection import Failure
from opsd.storage import inspect_checkpoints, open_store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalRunSpec:
    run: str
    command: tuple[str, ...]
    nodes: int = 2
    gpus_per_node: int = 2
    spares: int = 1
    workdir: str = ".opsd/runs"
    controller_url: str = ""  # the agents' heartbeat endpoint
    token: str = ""
    checkpoint_url: str = ""  # where the trainer checkpoints: tells which step a launch resumes from
    heartbeat_interval_s: float = 0.5
    gpu_interval_s: float = 0.2
    extra_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("run: a trainer command is needed (after --)")
        if self.nodes < 1 or self.gpus_per_node < 1 or self.spares < 0:
            raise ValueError("run: --nodes and --gpus-per-node must be >= 1, --spares >= 0")
        if not self.run or "/" in self.run:
            raise ValueError("run: the run name must be non-empty, without '/'")

    @property
    def root(self) -> Path:
        return Path(self.workdir) / self.run

    def node_dir(self, node: str) -> Path:
        return self.root / "nodes" / node


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RankProcess:
    rank: int
    node: str
    proc: subprocess.Popen[bytes]
    reported_exit: bool = False


class LocalBackend:
    def __init__(self, spec: LocalRunSpec) -> None:
        self.spec = spec
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.ranks: list[RankProcess] = []
        self.generation = 0
        self.lock = threading.RLock()
        self.slowdowns: dict[int, threading.Event] = {}
        self.resumed_from: int | None = None
        self.recovering: threading.Thread | None = None

    # -- nodes -------------------------------------------------------------------------------------------------
    def node_names(self) -> list[str]:
        return [f"node-{i}" for i in range(self.spec.nodes + self.spec.spares)]

    def start(self, controller: Controller, now_s: float) -> None:
        """Register the run and its nodes, start an agent per node, launch the first generation."""
        spec = self.spec
        if not controller.store.create_run(
            spec.run, {"backend": "local", "nodes": spec.nodes, "spares": spec.spares}, now_s
        ):
            state = (controller.store.run(spec.run) or {}).get("state")
            raise PermanentError(
                f"run {spec.run!r} exists already in this state store ({state}); give another --run or --state-dir"
            )
        for i, node in enumerate(self.node_names()):
            role = "active" if i < spec.nodes else "spare"
            controller.store.upsert_node(node, now_s, run=spec.run, role=role, domain=f"rack{i % 2}")
            self._start_agent(node)
        self.launch(controller, now_s)

    def _start_agent(self, node: str) -> None:
        directory = self.spec.node_dir(node)
        gpus = directory / "gpus"
        gpus.mkdir(parents=True, exist_ok=True)
        if not (gpus / "gpus.json").exists():
            write_samples(
                gpus, [GpuSample(g, f"GPU-{node}-{g}", temperature_c=40.0) for g in range(self.spec.gpus_per_node)]
            )
        cmd = [
            sys.executable,
            "-m",
            "opsd",
            "agent",
            "--socket",
            str(directory / "agent.sock"),
            "--metrics-port",
            "0",
            "--node",
            node,
            "--gpu-source",
            f"file:{gpus}",
            "--gpu-interval-s",
            str(self.spec.gpu_interval_s),
            "--policy-file",
            str(directory / "policy.json"),
            "--heartbeat-interval-s",
            str(self.spec.heartbeat_interval_s),
            "--log-level",
            "WARNING",
        ]
        if self.spec.controller_url:
            cmd += ["--controller-url", self.spec.controller_url]
        env = {**os.environ, "OPSD_CONTROLLER_TOKEN": self.spec.token}
        log_file = (directory / "agent.log").open("ab")
        self.agents[node] = subprocess.Popen(
            cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )

    # -- ranks -------------------------------------------------------------------------------------------------
    def active_nodes(self, controller: Controller) -> list[str]:
        return [n["name"] for n in controller.store.nodes(self.spec.run) if n["role"] == "active"]

    def launch(self, controller: Controller, now_s: float) -> None:
        """Start generation ``generation + 1`` on the active nodes (the previous one must be stopped)."""
        with self.lock:
            nodes = self.active_nodes(controller)
            self.generation += 1
            controller.forget_ranks(self.spec.run, now_s)
            self.resumed_from = self._newest_checkpoint()
            controller.store.update_run(self.spec.run, now_s, state="running", generation=self.generation)
            gpn = self.spec.gpus_per_node
            world = len(nodes) * gpn
            port = free_port()
            self.ranks = []
            for i, node in enumerate(nodes):
                directory = self.spec.node_dir(node)
                for local in range(gpn):
                    rank = i * gpn + local
                    env = {
                        **os.environ,
                        **self.spec.extra_env,
                        "RANK": str(rank),
                        "LOCAL_RANK": str(local),
                        "WORLD_SIZE": str(world),
                        "LOCAL_WORLD_SIZE": str(gpn),
                        "GROUP_RANK": str(i),
                        "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port),
                        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                        "OPSD_RUN": self.spec.run,
                        "OPSD_NODE": node,
                        "OPSD_AGENT_SOCKET": str(directory / "agent.sock"),
                        "OPSD_POLICY_FILE": str(directory / "policy.json"),
                    }
                    out = (directory / f"rank{rank}.gen{self.generation}.log").open("wb")
                    proc = subprocess.Popen(
                        list(self.spec.command), env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                    )
                    self.ranks.append(RankProcess(rank, node, proc))
            self._write_pids()
            log.info(
                "run %s: generation %d launched on %s (%d ranks)",
                self.spec.run,
                self.generation,
                ", ".join(nodes),
                world,
            )

    def _write_pids(self) -> None:
        pids = {"generation": self.generation, "ranks": {str(r.rank): r.proc.pid for r in self.ranks}}
        path = self.spec.root / "ranks.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(pids))
        os.replace(tmp, path)

    def stop_ranks(self) -> None:
        """SIGKILL every rank of the current launch (and anything it started), and reap them. Idempotent."""
        with self.lock:
            for event in self.slowdowns.values():
                event.set()
            self.slowdowns.clear()
            for r in self.ranks:
                if r.proc.poll() is None:
                    for sig in (signal.SIGCONT, signal.SIGKILL):  # a stopped (hung) rank is killed too
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(r.proc.pid, sig)
            for r in self.ranks:
                try:
                    r.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    log.warning("rank %d (pid %d) did not die", r.rank, r.proc.pid)
                r.reported_exit = True

    def supervise(self, controller: Controller, now_s: float) -> bool:
        """Report rank exits (0 included: a finished rank is no hang) to the controller; True once every rank of the
        launch exited with 0 (the run is done)."""
        with self.lock:
            if not self.ranks:
                return False
            codes = []
            for r in self.ranks:
                code = r.proc.poll()
                codes.append(code)
                if code is not None and not r.reported_exit:
                    r.reported_exit = True
                    controller.rank_exited(self.spec.run, r.rank, r.node, code, now_s)
            return all(code == 0 for code in codes)

    def _newest_checkpoint(self) -> int | None:
        if not self.spec.checkpoint_url:
            return None
        try:
            found = inspect_checkpoints(open_store(self.spec.checkpoint_url))
        except OpsError as exc:
            log.warning("run %s: cannot look at its checkpoints: %s", self.spec.run, exc)
            return None
        return next((c.step for c in found if c.problem is None), 0)

    def resumed_from_step(self, run: str) -> int | None:
        return self.resumed_from

    # -- recovery ----------------------------------------------------------------------------------------------
    def recover(self, controller: Controller, run: str, incident_id: int, failure: Failure, now_s: float) -> None:
        """Start the recovery on a thread of its own (the controller goes on taking heartbeats meanwhile)."""
        with self.lock:
            if self.recovering is not None and self.recovering.is_alive():
                return
            self.recovering = threading.Thread(
                target=self._recover, args=(controller, run, incident_id, failure, now_s), name="opsd-recovery"
            )
            self.recovering.start()

    def _recover(self, controller: Controller, run: str, incident_id: int, failure: Failure, now_s: float) -> None:
        try:
            self.recover_now(controller, run, incident_id, failure, now_s)
        except Exception:
            log.exception("run %s: recovery from incident %d failed", run, incident_id)
            controller.store.update_run(run, time.time(), state="failed")

    def recover_now(self, controller: Controller, run: str, incident_id: int, failure: Failure, now_s: float) -> None:
        """Stop, cordon and swap (when the failure asks for it), relaunch: each step recorded before it is done."""
        store = controller.store
        steps: list[tuple[str, dict[str, Any]]] = [("stop", {"generation": self.generation})]
        if failure.swap:
            steps += [
                ("cordon", {"node": failure.node, "reason": failure.detail}),
                ("take_spare", {"for": failure.node}),
            ]
        steps.append(("launch", {"after_generation": self.generation}))
        for seq, (kind, args) in enumerate(steps):
            action = store.record_action(
                f"incident-{incident_id}-{seq}-{kind}",
                run=run,
                incident_id=incident_id,
                seq=seq,
                kind=kind,
                args=args,
                now_s=now_s,
            )
            if action.state == "done":
                continue
            if kind == "stop":
                self.stop_ranks()
            elif kind == "cordon":
                store.upsert_node(failure.node, now_s, role="cordoned", reason=failure.detail)
            elif kind == "take_spare":
                chosen = controller.take_spare(run, failure.node, now_s)
                if chosen is None:
                    store.update_run(run, now_s, state="waiting_for_spare")
                    log.warning("run %s: no spare left; waiting for one", run)
                    return  # taken up again when a node is uncordoned or added
                store.update_incident(incident_id, spare=chosen)
                log.info("run %s: %s replaces %s", run, chosen, failure.node)
            elif kind == "launch":
                self.launch(controller, time.time())
            store.complete_action(action.request_id, time.time())

    # -- fault injection ---------------------------------------------------------------------------------------
    def inject(
        self, kind: str, *, node: str = "", gpu: int = 0, xid: int = 79, rank: int = -1, factor: float = 1.3
    ) -> str:
        """Inject a fault; returns what was done, in words."""
        if kind == "xid":
            if node not in self.agents:
                raise PermanentError(f"inject xid: no node {node!r}")
            inject_xid(self.spec.node_dir(node) / "gpus", gpu, xid)
            return f"XID {xid} on {node} GPU {gpu}"
        target = next((r for r in self.ranks if r.rank == rank and r.proc.poll() is None), None)
        if target is None:
            raise PermanentError(f"inject {kind}: no running rank {rank}")
        if kind == "kill":
            os.kill(target.proc.pid, signal.SIGKILL)
            return f"rank {rank} (pid {target.proc.pid}) killed"
        if kind == "hang":
            os.kill(target.proc.pid, signal.SIGSTOP)
            return f"rank {rank} (pid {target.proc.pid}) stopped (SIGSTOP)"
        if kind == "slow":
            if factor <= 1:
                raise PermanentError("inject slow: --factor must be > 1")
            stop = threading.Event()
            self.slowdowns[rank] = stop
            threading.Thread(target=_duty_cycle, args=(target.proc.pid, factor, stop), daemon=True).start()
            return f"rank {rank} slowed down {factor}x (SIGSTOP/SIGCONT duty cycle)"
        raise PermanentError(f"inject: unknown fault {kind!r} (xid, kill, hang, slow)")

    def close(self) -> None:
        self.stop_ranks()
        for proc in self.agents.values():
            proc.terminate()
        for proc in self.agents.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def _duty_cycle(pid: int, factor: float, stop: threading.Event, period_s: float = 0.1) -> None:
    """Run ``pid`` 1/factor of the time: stopped for (1 - 1/factor) of every period."""
    stopped_s = period_s * (1.0 - 1.0 / factor)
    running_s = period_s - stopped_s
    try:
        while not stop.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stopped_s)
            os.kill(pid, signal.SIGCONT)
            stop.wait(running_s)
    except ProcessLookupError:
        return
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
