"""An in-memory backend that records every call: the machines of a cluster as data, for tests.

It keeps what the Backend port (``opsd.controller.port``) promises and nothing more: every step is idempotent for
its request id (a repeat answers the first outcome and changes nothing), and its machines outlive the controller
that calls it (a new controller may be handed the same ``FakeBackend``, as a real cluster outlives its controller).
``calls`` lists every call, ``effects`` every change a call made; ``fail_next`` makes the next calls of a step
answer an error, to test how the controller handles one.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from opsd.controller.port import Done, ErrorKind, Failed, Fault, FaultKind, Outcome
from opsd.controller.steps import Once, Step
from opsd.protocol.steps import DumpReady, Injected, Launched, NodeChanged, Stopped

T = TypeVar("T")


@dataclass(frozen=True)
class Call:
    step: str
    request_id: str
    args: dict[str, object]


@dataclass
class FakeRun:
    generation: int = 0
    ranks: dict[int, str] = field(default_factory=dict)  # rank -> node, of the current launch
    resumed_from_step: int | None = None
    groups: dict[int, int] = field(default_factory=dict)  # a fault-tolerant run's: rank -> replica group
    group_launches: dict[int, int] = field(default_factory=dict)  # replica group -> its launch


class FakeBackend:
    name = "fake"

    def __init__(
        self, nodes: Sequence[str] = (), *, gpus_per_node: int = 1, checkpoint_step: int | None = None
    ) -> None:
        self.gpus_per_node = gpus_per_node
        self.checkpoint_step = checkpoint_step  # what a launch resumes from
        self.nodes: dict[str, str] = dict.fromkeys(nodes, "ready")  # node -> ready | quarantined
        self.runs: dict[str, FakeRun] = {}
        self.calls: list[Call] = []
        self.effects: list[Call] = []
        self.faults: list[tuple[str, Fault]] = []
        self.fail_next: dict[str, list[Failed]] = {}  # step -> the errors its next calls answer
        self.down: set[str] = set()  # nodes the cluster sees down (``node_ready``)
        self._once_per_request = Once()
        self._lock = threading.Lock()

    # -- the port ----------------------------------------------------------------------------------------------
    def stop_ranks(
        self, run: str, request_id: str, group: int | None = None, launch: int | None = None
    ) -> Outcome[Stopped]:
        # ``launch`` is the current one: the ranks are launched again by the controller alone
        def stop() -> Outcome[Stopped]:
            state = self.runs.setdefault(run, FakeRun())
            stopped = [r for r in state.ranks if group is None or state.groups.get(r) == group]
            for rank in stopped:
                del state.ranks[rank]
            if stopped:
                self._effect("stop_ranks", request_id, run=run, group=group)
            launch = state.group_launches.get(group, state.generation) if group is not None else state.generation
            return Done(Stopped(killed=len(stopped), launch=launch))

        args = {"run": run, **({"group": group} if group is not None else {})}
        return self._once("stop_ranks", request_id, args, stop)

    def quarantine_node(self, run: str, node: str, reason: str, request_id: str) -> Outcome[NodeChanged]:
        def quarantine() -> Outcome[NodeChanged]:
            return self._put_node(node, "quarantined", "quarantine_node", request_id)

        return self._once("quarantine_node", request_id, {"run": run, "node": node, "reason": reason}, quarantine)

    def release_node(self, node: str, request_id: str) -> Outcome[NodeChanged]:
        def release() -> Outcome[NodeChanged]:
            return self._put_node(node, "ready", "release_node", request_id)

        return self._once("release_node", request_id, {"node": node}, release)

    def promote_spare(self, run: str, spare: str, replaces: str, request_id: str) -> Outcome[NodeChanged]:
        def promote() -> Outcome[NodeChanged]:
            if self.nodes.get(spare) != "ready":
                return Failed(ErrorKind.PERMANENT, f"node {spare!r} is not a ready spare")
            self._effect("promote_spare", request_id, node=spare, replaces=replaces)
            return Done(NodeChanged(changed=True))

        return self._once("promote_spare", request_id, {"run": run, "spare": spare, "replaces": replaces}, promote)

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
            bad = [n for n in nodes if self.nodes.get(n) != "ready"]
            if bad or not nodes:
                return Failed(ErrorKind.PERMANENT, f"cannot launch on {list(nodes)}: not ready {bad}")
            state = self.runs.setdefault(run, FakeRun())
            gpn = self.gpus_per_node
            if group is None:
                state.generation = generation
                state.ranks = {i * gpn + g: node for i, node in enumerate(nodes) for g in range(gpn)}
                state.resumed_from_step = self.checkpoint_step
            else:  # the group's ranks keep their numbers in the job: the first ``len(nodes) * gpn`` of the group's
                first = group * len(nodes) * gpn
                state.ranks.update({first + i * gpn + g: node for i, node in enumerate(nodes) for g in range(gpn)})
                state.groups.update({first + i: group for i in range(len(nodes) * gpn)})
                state.group_launches[group] = generation
            self._effect("relaunch", request_id, run=run, generation=generation, nodes=list(nodes), group=group)
            resumed = self.checkpoint_step if group is None else None
            return Done(Launched(resumed_from_step=resumed, skipped=[], launch=generation))

        args = {
            "run": run,
            "generation": generation,
            "nodes": list(nodes),
            **({"group": group} if group is not None else {}),
        }
        return self._once("relaunch", request_id, args, launch)

    def request_dump(self, run: str, trigger: str, request_id: str) -> Outcome[DumpReady]:
        def ready() -> Outcome[DumpReady]:
            return Done(DumpReady(ranks=sorted(self.runs.get(run, FakeRun()).ranks)))

        return self._once("request_dump", request_id, {"run": run, "trigger": trigger}, ready)

    def inject(self, run: str, fault: Fault, request_id: str) -> Outcome[Injected]:
        def inject() -> Outcome[Injected]:
            if fault.kind is FaultKind.XID and fault.node not in self.nodes:
                return Failed(ErrorKind.PERMANENT, f"no node {fault.node!r}")
            self.faults.append((run, fault))
            self._effect("inject", request_id, run=run, fault=fault.kind.value)
            return Done(Injected(injected=f"{fault.kind.value} (fake)"))

        return self._once("inject", request_id, {"run": run, "fault": fault.kind.value}, inject)

    def node_ready(self, node: str) -> bool | None:
        """A known node is up unless it is in ``down``; None for a node this cluster does not have."""
        if node not in self.nodes:
            return None
        return node not in self.down

    def resumed_from(self, run: str) -> int | None:
        state = self.runs.get(run)
        return state.resumed_from_step if state is not None else None

    # -- bookkeeping -------------------------------------------------------------------------------------------
    def _once(self, step: str, request_id: str, args: dict[str, object], carry_out: Step[T]) -> Outcome[T]:
        with self._lock:
            self.calls.append(Call(step, request_id, args))

            def attempt() -> Outcome[T]:
                failures = self.fail_next.get(step)
                return failures.pop(0) if failures else carry_out()

            return self._once_per_request(request_id, attempt)

    def _effect(self, step: str, request_id: str, **args: Any) -> None:
        self.effects.append(Call(step, request_id, args))

    def _put_node(self, node: str, state: str, step: str, request_id: str) -> Outcome[NodeChanged]:
        """Put ``node`` in ``state`` (``ready`` or ``quarantined``): an effect of ``step`` only where it was not."""
        if node not in self.nodes:
            return Failed(ErrorKind.NOT_FOUND, f"no node {node!r}")
        changed = self.nodes[node] != state
        if changed:
            self.nodes[node] = state
            self._effect(step, request_id, node=node)
        return Done(NodeChanged(changed=changed))
