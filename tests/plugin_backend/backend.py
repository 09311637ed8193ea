"""The ledger backend: the Backend port (``opsd.controller.port``) on machines kept in one JSON file.

The ledger: ``nodes`` (node -> ``ready`` or ``quarantined``), ``runs`` (run -> its ``nodes`` and ``spares``, as a
scheduler's job list has them), ``launches`` (run -> the generation running and its ranks: rank -> node), ``done``
(request id -> the outcome answered) and ``effects`` (each change made: request id and step, oldest first). Each
step reads it, changes it and writes it back under a lock; a request id in ``done`` answers its outcome again and
changes nothing. Replica groups are not run here (``UNSUPPORTED``).
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar, cast

import msgspec

from opsd.controller.port import Done, ErrorKind, Failed, Fault, Outcome
from opsd.protocol.steps import DumpReady, Injected, Launched, NodeChanged, Stopped
from tests.plugin_backend.config import LedgerConfig

T = TypeVar("T")
Ledger = dict[str, Any]
#: the results a ledger keeps, by name
RESULTS: dict[str, type[msgspec.Struct]] = {
    kind.__name__: kind for kind in (Stopped, NodeChanged, Launched, DumpReady, Injected)
}


class LedgerPart(msgspec.Struct, frozen=True):
    """The ledger backend's own part of a run's spec (``RunSpec.own``): the run as the ledger lists it."""

    nodes: list[str]
    spares: list[str]


def new_ledger(path: Path, runs: dict[str, LedgerPart]) -> None:
    """A ledger of ``runs``, their nodes and spares ready, none launched."""
    nodes = {n: "ready" for part in runs.values() for n in [*part.nodes, *part.spares]}
    ledger = {"nodes": nodes, "runs": msgspec.to_builtins(runs), "launches": {}, "done": {}, "effects": []}
    path.write_text(json.dumps(ledger))


def read_ledger(path: Path) -> Ledger:
    ledger: Ledger = json.loads(path.read_text())
    return ledger


class LedgerBackend:
    name = "ledger"

    def __init__(self, config: LedgerConfig) -> None:
        self.config = config
        self.path = Path(config.path)

    # -- the port ----------------------------------------------------------------------------------------------
    def stop_ranks(
        self, run: str, request_id: str, group: int | None = None, launch: int | None = None
    ) -> Outcome[Stopped]:
        def stop(ledger: Ledger) -> Outcome[Stopped]:
            current = ledger["launches"].get(run) or {"generation": 0, "ranks": {}}
            killed = len(current["ranks"])
            if killed:
                current["ranks"] = {}
                ledger["launches"][run] = current
                ledger["effects"].append([request_id, "stop_ranks"])
            return Done(Stopped(killed=killed, launch=current["generation"]))

        return self._step(request_id, group, stop)

    def quarantine_node(self, run: str, node: str, reason: str, request_id: str) -> Outcome[NodeChanged]:
        return self._step(request_id, None, lambda ledger: self._put(ledger, node, "quarantined", request_id))

    def release_node(self, node: str, request_id: str) -> Outcome[NodeChanged]:
        return self._step(request_id, None, lambda ledger: self._put(ledger, node, "ready", request_id))

    def promote_spare(self, run: str, spare: str, replaces: str, request_id: str) -> Outcome[NodeChanged]:
        def promote(ledger: Ledger) -> Outcome[NodeChanged]:
            if ledger["nodes"].get(spare) != "ready":
                return Failed(ErrorKind.PERMANENT, f"node {spare!r} is not a ready spare")
            ledger["effects"].append([request_id, "promote_spare"])
            return Done(NodeChanged(changed=True))

        return self._step(request_id, None, promote)

    def relaunch(
        self,
        run: str,
        generation: int,
        nodes: Sequence[str],
        request_id: str,
        group: int | None = None,
        stopped: int | None = None,
    ) -> Outcome[Launched]:
        def launch(ledger: Ledger) -> Outcome[Launched]:
            bad = [n for n in nodes if ledger["nodes"].get(n) != "ready"]
            if bad or not nodes:
                return Failed(ErrorKind.PERMANENT, f"cannot launch on {list(nodes)}: not ready {bad}")
            gpn = self.config.gpus_per_node
            ranks = {str(i * gpn + g): node for i, node in enumerate(nodes) for g in range(gpn)}
            ledger["launches"][run] = {"generation": generation, "ranks": ranks}
            ledger["effects"].append([request_id, "relaunch"])
            return Done(Launched(skipped=[], launch=generation))

        return self._step(request_id, group, launch)

    def request_dump(self, run: str, trigger: str, request_id: str) -> Outcome[DumpReady]:
        def ready(ledger: Ledger) -> Outcome[DumpReady]:
            ranks = (ledger["launches"].get(run) or {}).get("ranks") or {}
            return Done(DumpReady(ranks=sorted(int(r) for r in ranks)))

        return self._step(request_id, None, ready)

    def inject(self, run: str, fault: Fault, request_id: str) -> Outcome[Injected]:
        return Failed(ErrorKind.UNSUPPORTED, "the ledger's machines take no fault")

    def resumed_from(self, run: str) -> int | None:
        return None  # the ranks say it in their reports

    # -- the ledger ----------------------------------------------------------------------------------------------
    def placement(self, run: str) -> dict[int, str]:
        """The ranks of the run's launch: rank -> node."""
        ranks = (read_ledger(self.path)["launches"].get(run) or {}).get("ranks") or {}
        return {int(r): n for r, n in ranks.items()}

    def _put(self, ledger: Ledger, node: str, state: str, request_id: str) -> Outcome[NodeChanged]:
        if node not in ledger["nodes"]:
            return Failed(ErrorKind.NOT_FOUND, f"no node {node!r}")
        changed = ledger["nodes"][node] != state
        if changed:
            ledger["nodes"][node] = state
            ledger["effects"].append([request_id, "quarantine_node" if state == "quarantined" else "release_node"])
        return Done(NodeChanged(changed=changed))

    def _step(self, request_id: str, group: int | None, carry_out: Callable[[Ledger], Outcome[T]]) -> Outcome[T]:
        """``carry_out`` on the ledger once for ``request_id``: a request id done answers its outcome again."""
        if group is not None:
            return Failed(ErrorKind.UNSUPPORTED, "the ledger runs no replica groups")
        with self._locked() as ledger:
            answered = ledger["done"].get(request_id)
            if answered is not None:
                return Done(cast(T, msgspec.convert(answered["data"], RESULTS[answered["result"]])))
            outcome = carry_out(ledger)
            if isinstance(outcome, Done):
                result = {"result": type(outcome.data).__name__, "data": msgspec.to_builtins(outcome.data)}
                ledger["done"][request_id] = result
            return outcome

    @contextmanager
    def _locked(self) -> Iterator[Ledger]:
        """The ledger, read under an exclusive lock and written back (whole, then renamed) when the block ends."""
        with open(f"{self.path}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            ledger = read_ledger(self.path)
            yield ledger
            staged = self.path.with_name(self.path.name + ".new")
            staged.write_text(json.dumps(ledger))
            os.replace(staged, self.path)
