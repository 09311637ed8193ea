"""The local backend: the Backend port (``opsd.controller.port``) over rank processes on this machine. Each "node"
is a group of rank processes plus its own agent (``opsd.backends.local.processes``); spares are extra node slots
with an agent and no ranks. The embedded default, for laptops, CI and the demo.

The steps of the port, here:

- ``stop_ranks``: SIGKILL every rank of the launch (its process group);
- ``quarantine_node`` / ``release_node``: nothing to do on the machine (a local node has no scheduler to keep off
  it); the controller's state store keeps it out of the run;
- ``promote_spare``: nothing either: a spare's agent already runs, and the next launch places ranks on the nodes
  the controller names;
- ``relaunch``: what still runs of a launch is stopped, then the generation's ranks start on the nodes named; the
  trainer resumes from its newest checkpoint by itself (the reference trainer: ``--ckpt-dir URL --resume``); the
  step it will resume from is read from the checkpoint store first;
- ``request_dump``: the ranks still running (the controller asks them for dumps through its policy);
- ``inject``: ``opsd.backends.local.injection``.

Each step is idempotent for its request id while this backend lives: a repeat answers what the first call did.
A controller that dies takes its backend's memory with it; the next one kills what the dead one left
(``take_up_machines``), so its steps start afresh. Every change a step makes to the machines is written, one JSON
line each, to ``<run>/backend.jsonl``: what this backend did, and for which request.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from opsd.backends.local import processes
from opsd.backends.local.injection import Injector
from opsd.backends.local.processes import RankExit, RankProcess
from opsd.backends.local.spec import LocalRunSpec
from opsd.checkpoints.layout import inspect_checkpoints
from opsd.checkpoints.store import open_store
from opsd.controller.port import Done, ErrorKind, Failed, Fault, Outcome
from opsd.controller.steps import Once, Step, as_outcome
from opsd.errors import BodyError, OpsError
from opsd.protocol.steps import DumpReady, Injected, Launched, NodeChanged, Stopped, Unusable

log = logging.getLogger(__name__)
T = TypeVar("T")


class LocalBackend:
    name = "local"

    def __init__(self, spec: LocalRunSpec) -> None:
        self.spec = spec
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.ranks: list[RankProcess] = []
        self.generation = 0
        self.lock = threading.RLock()
        self.injector = Injector(spec)
        self.resumed_from_step: int | None = None
        self.skipped: list[Unusable] = []  # checkpoints newer than the one resumed from, and why
        self.lock_fd: int | None = None
        self.instance = uuid.uuid4().hex[:12]  # names this backend's lines in backend.jsonl
        self.lighthouse: subprocess.Popen[bytes] | None = None  # a fault-tolerant run's
        self.lighthouse_address = ""
        self.lighthouse_port = 0
        self.lighthouse_restarts = 0
        self._lighthouse_retry_mono_s = 0.0  # a Lighthouse that died is not started again before then (monotonic)
        self.group_launches: dict[int, int] = {}  # a fault-tolerant run's: each replica group's launch
        self._once_per_request = Once()

    # -- the machines ------------------------------------------------------------------------------------------
    def lock_run(self) -> None:
        """Take the run's lock (``PermanentError`` when another controller holds it)."""
        self.lock_fd = processes.lock_run(self.spec)

    def start_agents(self) -> None:
        """Start an agent on every node and spare of the run, and a fault-tolerant run's Lighthouse beside the
        controller (the replica groups find each other through it)."""
        for node in self.spec.node_names():
            self.agents[node] = processes.start_agent(self.spec, node)
        if self.spec.replica_groups > 1:
            self.lighthouse, port = processes.start_lighthouse(self.spec)
            self.lighthouse_address, self.lighthouse_port = f"http://127.0.0.1:{port}", port
            processes.wait_listening(self.lighthouse, port)
            log.info("run %s: the Lighthouse listens at %s", self.spec.run, self.lighthouse_address)
        self._record_processes()

    def take_up_machines(self, generation: int) -> int:
        """A controller takes up a run whose controller stopped: kill what the dead one left running, restart the
        agents; how many processes were killed."""
        killed = processes.kill_orphans(self.spec)
        self.generation = generation
        self.start_agents()
        return killed

    def supervise(self) -> tuple[list[RankExit], bool]:
        """The rank exits not reported yet (0 included: a finished rank is no hang), and
        whether every rank of the launch exited with 0 (the run is done; in a fault-tolerant run, every rank of the
        groups running: a group stopped for want of a node does not hold the others' end). A fault-tolerant run's
        Lighthouse that died is started again at its address (``_keep_lighthouse``)."""
        self._keep_lighthouse()
        with self.lock:
            if not self.ranks:
                return [], False
            exits, codes = [], []
            for r in self.ranks:
                code = r.proc.poll()
                codes.append(code)
                if code is not None and not r.reported_exit:
                    r.reported_exit = True
                    exits.append(RankExit(r.rank, r.node, code, r.launch, r.group))
            return exits, all(code == 0 for code in codes)

    def _keep_lighthouse(self) -> None:
        """Start the Lighthouse again, on its port, when it died: the groups' quorum requests are tried again
        meanwhile (torchft's ``quorum_retries``), and a relaunch's ranks are told the same address. At most once a
        second (a port taken by something else would fail every start)."""
        with self.lock:
            proc = self.lighthouse
            if proc is None or proc.poll() is None or time.monotonic() < self._lighthouse_retry_mono_s:
                return
            self._lighthouse_retry_mono_s = time.monotonic() + 1.0
            code = proc.returncode
            self.lighthouse, _ = processes.start_lighthouse(self.spec, self.lighthouse_port)
            self.lighthouse_restarts += 1
            log.warning(
                "run %s: the Lighthouse exited (%s); started again at %s", self.spec.run, code, self.lighthouse_address
            )
            self._effect("supervise", "lighthouse_restarted", {"exit_code": code, "port": self.lighthouse_port})
            self._record_processes()

    def kill_ranks(self, group: int | None = None) -> int:
        """Stop every rank now (``opsd run`` stopped by an operator), or every rank of replica group ``group``; how
        many were running. The stopped ranks leave the launch."""
        with self.lock:
            self.injector.release()
            chosen = [r for r in self.ranks if group is None or r.group == group]
            killed = processes.stop_ranks(chosen)
            self.ranks = [r for r in self.ranks if r not in chosen]
            return killed

    def close(self) -> None:
        """Stop the ranks, the agents and the Lighthouse, release the run's lock."""
        self.kill_ranks()
        if self.lighthouse is not None:
            processes.kill_group(self.lighthouse.pid)
            self.lighthouse.wait(timeout=10)
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

    # -- the port ----------------------------------------------------------------------------------------------
    def stop_ranks(
        self, run: str, request_id: str, group: int | None = None, launch: int | None = None
    ) -> Outcome[Stopped]:
        # ``launch`` is the current one: the ranks are launched again by the controller alone
        def stop() -> Outcome[Stopped]:
            launch = self.group_launches.get(group, self.generation) if group is not None else self.generation
            killed = self.kill_ranks(group)
            if killed:
                self._effect(request_id, "stop_ranks", {"killed": killed, "generation": launch, "group": group})
            return Done(Stopped(killed=killed, launch=launch))

        return self._once(run, request_id, stop)

    def quarantine_node(self, run: str, node: str, reason: str, request_id: str) -> Outcome[NodeChanged]:
        return self._once(run, request_id, lambda: self._known_node(node) or Done(NodeChanged()))

    def release_node(self, node: str, request_id: str) -> Outcome[NodeChanged]:
        return self._once(self.spec.run, request_id, lambda: self._known_node(node) or Done(NodeChanged()))

    def promote_spare(self, run: str, spare: str, replaces: str, request_id: str) -> Outcome[NodeChanged]:
        return self._once(run, request_id, lambda: self._known_node(spare) or Done(NodeChanged()))

    def relaunch(
        self,
        run: str,
        generation: int,
        nodes: Sequence[str],
        request_id: str,
        group: int | None = None,
        stopped: int | None = None,
    ) -> Outcome[Launched]:
        def launch() -> Outcome[Launched]:
            unknown = [n for n in nodes if n not in self.spec.node_names()]
            if unknown or not nodes:
                return Failed(ErrorKind.PERMANENT, f"cannot launch on {list(nodes)}: no such local nodes {unknown}")
            if group is not None and not 0 <= group < self.spec.replica_groups:
                return Failed(ErrorKind.PERMANENT, f"run {run!r} has no replica group {group}")
            with self.lock:
                self.kill_ranks(group)
                started = processes.start_ranks(
                    self.spec, list(nodes), generation, group=group, lighthouse=self.lighthouse_address
                )
                if group is None:
                    self.generation = generation
                    self.resumed_from_step = self._newest_checkpoint()
                    self.group_launches = dict.fromkeys(range(self.spec.replica_groups), generation)
                else:  # the group heals from a live one: it resumes from no checkpoint
                    self.group_launches[group] = generation
                self.ranks += started
                self._record_processes()
            pids = [r.proc.pid for r in started]
            detail = {"generation": generation, "nodes": list(nodes), "pids": pids, "group": group}
            self._effect(request_id, "relaunch", detail)
            what = "generation" if group is None else f"replica group {group}, launch"
            log.info("run %s: %s %d started on %s (%d ranks)", run, what, generation, ", ".join(nodes), len(pids))
            resumed = self.resumed_from_step if group is None else None
            return Done(Launched(resumed_from_step=resumed, skipped=list(self.skipped), launch=generation))

        return self._once(run, request_id, launch)

    def request_dump(self, run: str, trigger: str, request_id: str) -> Outcome[DumpReady]:
        def ready() -> Outcome[DumpReady]:
            with self.lock:
                return Done(DumpReady(ranks=[r.rank for r in self.ranks if r.proc.poll() is None]))

        return self._once(run, request_id, ready)

    def inject(self, run: str, fault: Fault, request_id: str) -> Outcome[Injected]:
        def inject() -> Outcome[Injected]:
            with self.lock:
                try:
                    done = self.injector.inject(fault, set(self.agents), self.ranks)
                except BodyError as exc:
                    return Failed(ErrorKind.PERMANENT, str(exc))
            self._effect(request_id, "inject", {"fault": fault.kind.value, "injected": done})
            return Done(Injected(injected=done))

        return self._once(run, request_id, inject)

    def node_ready(self, node: str) -> bool | None:
        """Whether the current launch's rank processes on ``node`` all run (none exited or stopped: a local node
        is its processes); None when it runs none."""
        with self.lock:
            here = [r for r in self.ranks if r.node == node]
        if not here:
            return None
        return all(processes.running(r.proc) for r in here)

    def resumed_from(self, run: str) -> int | None:
        return self.resumed_from_step if run == self.spec.run else None

    # -- bookkeeping -------------------------------------------------------------------------------------------
    def _once(self, run: str, request_id: str, step: Step[T]) -> Outcome[T]:
        """``step()`` once per request id (a repeat answers the first outcome; a failure may be tried again), opsd's
        errors as data."""
        if run != self.spec.run:
            return Failed(ErrorKind.NOT_FOUND, f"run {run!r} is not run by this controller")
        with self.lock:
            return self._once_per_request(request_id, lambda: as_outcome(request_id, step))

    def _known_node(self, node: str) -> Failed | None:
        if node in self.spec.node_names():
            return None
        return Failed(ErrorKind.NOT_FOUND, f"no local node {node!r}")

    def _effect(self, request_id: str, step: str, detail: dict[str, Any]) -> None:
        line = {"time_unix_s": time.time(), "backend": self.instance, "request_id": request_id, "step": step}
        path = self.spec.root / "backend.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps({**line, **detail}) + "\n")

    def _record_processes(self) -> None:
        with self.lock:
            others = {"lighthouse": self.lighthouse} if self.lighthouse is not None else {}
            processes.write_processes(self.spec, self.generation, self.agents, self.ranks, others)

    def _newest_checkpoint(self) -> int | None:
        if not self.spec.checkpoint_url:
            return None
        try:
            found = inspect_checkpoints(open_store(self.spec.checkpoint_url))
        except OpsError as exc:
            log.warning("run %s: cannot look at its checkpoints: %s", self.spec.run, exc)
            return None
        newest = next((c.step for c in found if c.problem is None), 0)
        self.skipped = [Unusable(step=c.step, problem=c.problem) for c in found if c.step > newest]
        return newest


def effects(spec: LocalRunSpec) -> list[dict[str, Any]]:
    """What the run's local backends did to its machines, oldest first (``<run>/backend.jsonl``)."""
    path: Path = spec.root / "backend.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
