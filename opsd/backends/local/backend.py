"""The local backend: each "node" is a group of rank processes on this machine plus its own agent; spares are
extra node slots with an agent and no ranks. The embedded default, for laptops, CI and the demo.

Ranks get torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``) plus ``OPSD_RUN``, ``OPSD_NODE``, ``OPSD_AGENT_SOCKET``, ``OPSD_POLICY_FILE`` and
``OPSD_FLIGHT_DIR`` (``<node dir>/flight``, where the node's agent picks their Flight Recorder dumps up);
each launch (a generation) gets a fresh rendezvous port. The trainer command must resume from its newest
checkpoint by itself (the reference trainer: ``--ckpt-dir URL --resume``).

A recovery is a list of actions, each recorded in the state store under a request id before it is carried out
and marked done (with what it did) after: ``dump`` (a hang's: the ranks' Flight Recorder dumps, asked for through
the policy and awaited up to ``flight_wait_s``), ``stop`` (every rank of the launch, SIGKILL to its process group),
``cordon`` (when the failure asks for a swap), ``take_spare``, ``launch``. Each is idempotent: the spare chosen is
written to the incident before the node changes role, and ``launch`` starts the generation its record names. With
no spare left the run waits (``waiting_for_spare``, until a node is uncordoned or added) or, when the spec allows
it (``on_no_spare="shrink"``, ``min_nodes``), relaunches on the nodes it has left; the trainer then sees a smaller
world (the reference trainer: ``--mesh dp_shard=-1,...``).

A controller that stops (killed, machine rebooted) leaves its agents and ranks running; their process ids and start
times are in ``<run>/processes.json``. Running ``opsd run`` again with the same run name and state takes the run up:
it kills what the old controller left (checking start times, so that a reused pid is not hit), then goes on with
the recovery that was under way, skipping the actions already done, or, when none was, records a
``controller_restart`` incident and relaunches from the newest checkpoint. A lock file (``flock``) keeps two
controllers off one run.

Fault injection (``inject``) is real: an XID appended to a node's GPU source, SIGKILL, SIGSTOP (a hang), or a
SIGSTOP/SIGCONT duty cycle that slows a rank down by a factor.
"""

from __future__ import annotations

import contextlib
import fcntl
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
from opsd.api.flight import collect_dumps
from opsd.checkpoints.store import inspect_checkpoints, open_store
from opsd.controller.controller import Controller, failure_of
from opsd.errors import OpsError, PermanentError
from opsd.policy.detection import Failure, FailureKind

log = logging.getLogger(__name__)

TERMINAL_STATES = ("completed", "failed", "stopped")
ON_NO_SPARE = ("wait", "shrink")


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
    on_no_spare: str = "wait"  # or "shrink": relaunch on the nodes left, down to min_nodes
    min_nodes: int = 1
    crash_after_action: str = ""  # fault injection (tests): SIGKILL this controller once an action of this kind is done

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("run: a trainer command is needed (after --)")
        if self.nodes < 1 or self.gpus_per_node < 1 or self.spares < 0:
            raise ValueError("run: --nodes and --gpus-per-node must be >= 1, --spares >= 0")
        if self.on_no_spare not in ON_NO_SPARE:
            raise ValueError(f"run: --on-no-spare must be one of {', '.join(ON_NO_SPARE)}")
        if not 1 <= self.min_nodes <= self.nodes:
            raise ValueError("run: --min-nodes must be between 1 and --nodes")
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
        self.skipped: list[dict[str, Any]] = []  # checkpoints newer than the one resumed from, and why
        self.recovering: threading.Thread | None = None
        self.lock_fd: int | None = None

    # -- nodes -------------------------------------------------------------------------------------------------
    def node_names(self) -> list[str]:
        return [f"node-{i}" for i in range(self.spec.nodes + self.spec.spares)]

    def start(self, controller: Controller, now_s: float) -> None:
        """Register the run and its nodes, start an agent per node, launch the first generation; or take the run up
        when the state store has it unfinished (its controller stopped)."""
        spec = self.spec
        existing = controller.store.run(spec.run)
        if existing is not None and existing["state"] in TERMINAL_STATES:
            raise PermanentError(
                f"run {spec.run!r} is {existing['state']} in this state store; give another --run or --state-dir"
            )
        self._lock()
        if existing is not None:
            self.take_up(controller, existing, now_s)
            return
        recorded = {
            "backend": "local",
            "nodes": spec.nodes,
            "spares": spec.spares,
            "gpus_per_node": spec.gpus_per_node,
            "checkpoint_url": spec.checkpoint_url,
        }
        controller.store.create_run(spec.run, recorded, now_s)
        for i, node in enumerate(self.node_names()):
            role = "active" if i < spec.nodes else "spare"
            controller.store.upsert_node(node, now_s, run=spec.run, role=role, domain=f"rack{i % 2}")
            self._start_agent(node)
        self.launch(controller, now_s, generation=1)

    def _lock(self) -> None:
        """One controller per run: an exclusive ``flock`` on ``<run>/controller.lock``, released when it exits."""
        path = self.spec.root / "controller.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            message = f"run {self.spec.run!r} has another opsd run supervising it ({path} is locked)"
            raise PermanentError(message) from None
        self.lock_fd = fd

    def take_up(self, controller: Controller, run: dict[str, Any], now_s: float) -> None:
        """Go on with a run whose controller stopped: kill what it left running, restart the agents, and carry on
        with the recovery under way (or relaunch, recorded as a ``controller_restart`` incident)."""
        spec = self.spec
        recorded = run["spec"]
        if (recorded.get("nodes"), recorded.get("spares")) != (spec.nodes, spec.spares):
            raise PermanentError(
                f"run {spec.run!r} was started with --nodes {recorded.get('nodes')} --spares {recorded.get('spares')};"
                " take it up with the same"
            )
        store = controller.store
        store.update_run(spec.run, now_s, state="recovering")
        killed = self._kill_orphans()
        self.generation = int(run["generation"])
        for node in self.node_names():
            self._start_agent(node)
        incident = controller.unfinished_incident(spec.run)
        if incident is None:
            failure = Failure(
                FailureKind.CONTROLLER_RESTART,
                "",
                None,
                f"the run's controller stopped during generation {self.generation}; {killed} processes it left killed",
            )
            incident_id, _ = store.open_incident(
                key=f"{spec.run}/gen{self.generation}",
                run=spec.run,
                kind=failure.kind.value,
                node="",
                rank=None,
                detail=failure.detail,
                failed_s=float(run["updated_s"]),  # the last thing the old controller wrote
                detected_s=now_s,
            )
        else:
            incident_id, failure = int(incident["id"]), failure_of(incident)
        log.warning(
            "run %s: taken up (was %s, generation %d): %d processes of the previous controller killed;"
            " recovery of incident %d (%s) goes on",
            spec.run,
            run["state"],
            self.generation,
            killed,
            incident_id,
            failure.kind.value,
        )
        self.recover(controller, spec.run, incident_id, failure, now_s)

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
            "--flight-dir",
            str(directory / "flight"),
            "--heartbeat-interval-s",
            str(self.spec.heartbeat_interval_s),
            "--log-level",
            "WARNING",
        ]
        if self.spec.controller_url:
            cmd += ["--controller-url", self.spec.controller_url]
        env = {**os.environ, "OPSD_CONTROLLER_TOKEN": self.spec.token}
        with (directory / "agent.log").open("ab") as log_file:
            self.agents[node] = subprocess.Popen(
                cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._write_processes()

    # -- ranks -------------------------------------------------------------------------------------------------
    def active_nodes(self, controller: Controller) -> list[str]:
        return [n["name"] for n in controller.store.nodes(self.spec.run) if n["role"] == "active"]

    def launch(self, controller: Controller, now_s: float, generation: int) -> list[str]:
        """Start ``generation`` on the active nodes (whatever still runs of a launch is stopped first); returns the
        nodes."""
        with self.lock:
            self.stop_ranks()
            nodes = self.active_nodes(controller)
            self.generation = generation
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
                        "OPSD_FLIGHT_DIR": str(directory / "flight"),
                    }
                    with (directory / f"rank{rank}.gen{self.generation}.log").open("wb") as out:
                        proc = subprocess.Popen(
                            list(self.spec.command),
                            env=env,
                            stdout=out,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                    self.ranks.append(RankProcess(rank, node, proc))
            self._write_processes()
            log.info(
                "run %s: generation %d launched on %s (%d ranks)",
                self.spec.run,
                self.generation,
                ", ".join(nodes),
                world,
            )
            return nodes

    # -- the processes a controller leaves behind --------------------------------------------------------------
    def _write_processes(self) -> None:
        """Record every agent and rank (pid and start time) in ``<run>/processes.json``, atomically."""
        with self.lock:
            record = {
                "generation": self.generation,
                "agents": {n: [p.pid, _start_time(p.pid)] for n, p in self.agents.items()},
                "ranks": {str(r.rank): [r.proc.pid, _start_time(r.proc.pid)] for r in self.ranks},
            }
            path = self.spec.root / "processes.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(record))
            os.replace(tmp, path)

    def _kill_orphans(self, timeout_s: float = 10.0) -> int:
        """SIGKILL the process groups a previous controller of this run recorded and that still run (the same pid
        *and* start time); returns how many."""
        path = self.spec.root / "processes.json"
        try:
            record = json.loads(path.read_text())
            pids = [
                int(p)
                for group in ("agents", "ranks")
                for p, start in record.get(group, {}).values()
                if start is not None and _start_time(int(p)) == start
            ]
        except FileNotFoundError:
            return 0
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            log.warning("run %s: %s is unreadable (%s): nothing killed", self.spec.run, path, exc)
            return 0
        for pid in pids:
            _kill_group(pid)
        deadline = time.monotonic() + timeout_s
        while any(_start_time(p) is not None for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        return len(pids)

    def stop_ranks(self) -> int:
        """SIGKILL every rank of the current launch (and anything it started), and reap them; returns how many were
        still running. Idempotent."""
        with self.lock:
            for event in self.slowdowns.values():
                event.set()
            self.slowdowns.clear()
            running = [r for r in self.ranks if r.proc.poll() is None]
            for r in running:
                _kill_group(r.proc.pid)
            for r in self.ranks:
                try:
                    r.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    log.warning("rank %d (pid %d) did not die", r.rank, r.proc.pid)
                r.reported_exit = True
            return len(running)

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
        newest = next((c.step for c in found if c.problem is None), 0)
        self.skipped = [{"step": c.step, "problem": c.problem} for c in found if c.step > newest]
        return newest

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
        """Stop, cordon and swap (when the failure asks for it), relaunch: each step recorded before it is done,
        the ones a previous attempt did skipped."""
        store = controller.store
        steps: list[tuple[str, dict[str, Any]]] = []
        if failure.kind is FailureKind.MANUAL_RESTART:  # graceful: a checkpoint first, when the ranks progress
            steps.append(("checkpoint", {"at_step": controller.checkpoint_step_ahead(run)}))
        if failure.kind in (FailureKind.HANG, FailureKind.COLLECTIVE_TIMEOUT):  # the post-mortem's evidence first
            steps.append(("dump", {"trigger": f"incident-{incident_id}"}))
        steps.append(("stop", {"generation": self.generation}))
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
            result: dict[str, Any] = {}
            if kind == "stop":
                result = {"killed": self.stop_ranks()}
            elif kind == "cordon":
                store.upsert_node(failure.node, now_s, role="cordoned", reason=failure.detail)
                result = {"node": failure.node}
            elif kind == "take_spare":
                chosen = self._take_spare(controller, run, incident_id, failure, now_s)
                left = len(self.active_nodes(controller))
                if chosen is not None:
                    result = {"spare": chosen}
                elif self.spec.on_no_spare == "shrink" and left >= self.spec.min_nodes:
                    result = {"spare": None, "shrunk_to_nodes": left}
                    log.warning("run %s: no spare left; going on with %d nodes", run, left)
                else:
                    store.update_run(run, now_s, state="waiting_for_spare")
                    log.warning("run %s: no spare left; waiting for one", run)
                    return  # the controller goes on once a node is uncordoned or added
            elif kind == "launch":
                generation = int(action.args["after_generation"]) + 1  # the record's: a repeat launches the same
                nodes = self.launch(controller, time.time(), generation)
                result = {
                    "generation": generation,
                    "nodes": nodes,
                    "resumed_from_step": self.resumed_from,
                    "skipped": self.skipped,  # newer checkpoints that could not be resumed from, and why
                }
            elif kind == "checkpoint":
                result = self._checkpoint_now(controller, run, action.args.get("at_step"))
            elif kind == "dump":
                with self.lock:
                    alive = [r.rank for r in self.ranks if r.proc.poll() is None]
                wait_s = controller.config.flight_wait_s
                result = collect_dumps(controller, run, str(action.args["trigger"]), alive, wait_s)
            store.complete_action(action.request_id, time.time(), result)
            if kind == self.spec.crash_after_action:
                log.critical("run %s: killing this controller after %s (fault injection)", run, action.request_id)
                os.kill(os.getpid(), signal.SIGKILL)

    def _checkpoint_now(self, controller: Controller, run: str, at_step: int | None) -> dict[str, Any]:
        """Ask the ranks for a checkpoint at ``at_step`` and wait until it is committed, the ranks stop
        progressing, or ``restart_checkpoint_wait_s`` passes; what happened, for the action's result."""
        if at_step is None or not self.spec.checkpoint_url:
            why = "no checkpoint store" if not self.spec.checkpoint_url else "the ranks were not progressing"
            return {"checkpoint_step": None, "why": why}
        controller.ask_checkpoint(run, at_step)
        start = time.monotonic()
        deadline = start + controller.config.restart_checkpoint_wait_s
        try:
            while time.monotonic() < deadline:
                newest = self._newest_checkpoint() or 0
                if newest >= at_step:
                    return {"checkpoint_step": newest, "asked_step": at_step, "waited_s": time.monotonic() - start}
                with self.lock:
                    ended = any(r.proc.poll() is not None for r in self.ranks)
                if ended:
                    return {"checkpoint_step": None, "asked_step": at_step, "why": "a rank ended meanwhile"}
                time.sleep(0.5)
        finally:
            controller.ask_checkpoint(run, None)
        return {"checkpoint_step": None, "asked_step": at_step, "why": "not committed in time"}

    def _take_spare(
        self, controller: Controller, run: str, incident_id: int, failure: Failure, now_s: float
    ) -> str | None:
        """The incident's spare: the one chosen before (a repeat) or a new one, written to the incident before the
        node becomes active, so that a repeat never takes a second."""
        store = controller.store
        chosen = (store.incident(incident_id) or {}).get("spare") or controller.choose_spare(run, failure.node)
        if chosen is None:
            return None
        store.update_incident(incident_id, spare=chosen)
        store.upsert_node(chosen, now_s, role="active")
        log.info("run %s: %s replaces %s", run, chosen, failure.node)
        return str(chosen)

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
        if self.recovering is not None:
            self.recovering.join(timeout=60)  # a recovery under way would launch after the stop otherwise
        self.stop_ranks()
        for proc in self.agents.values():
            proc.terminate()
        for proc in self.agents.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None


def _kill_group(pid: int) -> None:
    """SIGKILL the process group ``pid`` leads (SIGCONT first, so that a stopped, hung, process dies too)."""
    for sig in (signal.SIGCONT, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)


def _start_time(pid: int) -> int | None:
    """When a live process started (clock ticks since boot, from ``/proc/PID/stat``); None when it is gone or a
    zombie. With the pid, it names one process: pids are reused, start times with them are not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state is field 3, starttime field 22
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


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
