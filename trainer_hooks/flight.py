"""Flight Recorder dumps of a rank, for the post-mortem of a hang.

PyTorch's Flight Recorder keeps the last ``TORCH_FR_BUFFER_SIZE`` (2,000) collectives a rank issued, on NCCL and on
gloo alike, each with its process group, its sequence id in that group and the Python stack that issued it. Each
backend keeps its own record: gloo's comes from ``_dump_fr_trace``, NCCL's from ``_dump_nccl_trace`` (on an NCCL group
``_dump_fr_trace`` has no entry; NCCL's entries also have the collective's GPU duration, ``duration_ms``). A world
may have both (an NCCL world with a gloo group for checkpoints): a dump holds each. When a
run hangs, the controller wants that record from every rank: it puts a ``dump_flight_recorder`` command in the
policy (``trainer_hooks.policy_reader``), and a rank that waited too long on one collective dumps on its own
(``timeout-<rank>-<step>``). The monitor's watchdog thread calls :meth:`FlightRecorder.poll` and
:meth:`FlightRecorder.dump`; the training thread may be blocked in a collective all along.

A dump is one JSON file, ``$OPSD_FLIGHT_DIR/<run>/<trigger>/rank-<rank>.json``, written atomically (a temporary
file renamed over it), that the node agent uploads to the controller (docs/flight-recorder.md); a rank with no such
directory (a pod without the host directory) sends it to the agent at ``$OPSD_AGENT_HOST``, which writes it there
(``opsd.protocol.node_agent``):

- ``trace``: the Flight Recorder's own dump of the gloo (CPU) groups (``torch._C._distributed_c10d._dump_fr_trace``,
  with stack frames; the JSON variant has none), frames kept on the newest entry of each process group only (the
  others are the same few call sites over and over, and would make a dump of 2,000 entries several megabytes);
- ``nccl_trace``: the same of the NCCL groups (``_dump_nccl_trace``), where torch was built with NCCL;
- ``groups``: this rank's process groups, ``{name: {"desc", "ranks", "dim"}}``. gloo does not record their
  members in the trace (its ``pg_config`` is empty), and ``dim`` is the mesh dimension the monitor labelled;
- ``stack``: the training thread's Python stack as this thread sees it (``sys._current_frames()``), so a hang
  outside any collective shows where it is.

The first dump of a process may import what torch's symbolizer needs (``torch._inductor``, when nothing loaded it
before: about a second, the training thread competing for the interpreter); later ones take milliseconds to a few
hundred. Nothing here raises: failures are counted (``errors``) and logged once.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import socket
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from opsd.protocol.env import FLIGHT_DIR_ENV
from opsd.protocol.node_agent import path_part
from opsd.protocol.policy_file import DUMP_COMMAND
from trainer_hooks.collectives import TRACER, CollectiveTracer
from trainer_hooks.policy_reader import PolicyReader, policy_source
from trainer_hooks.sinks import agent_from_env, rank_headers

log = logging.getLogger(__name__)

DUMP_VERSION = 1
#: how many times a dump is sent to an agent that answers it is busy (503 with Retry-After) before it is given up
SEND_ATTEMPTS = 5


def process_groups(tracer: CollectiveTracer = TRACER) -> dict[str, dict[str, Any]]:
    """This rank's process groups by name: description, global ranks, and the mesh dimension of their label."""
    if not dist.is_initialized():
        return {}
    out: dict[str, dict[str, Any]] = {}
    for group, name in list(c10d._world.pg_names.items()):
        ranks = sorted(c10d._world.pg_group_ranks.get(group, {}))
        out[str(name)] = {
            "desc": str(getattr(group, "group_desc", "") or ""),
            "ranks": ranks,
            "dim": tracer.dimension_of(str(name)),
        }
    return out


def _plain(value: Any) -> Any:
    """The unpickled trace as JSON values (tuples become lists; anything else odd, its text)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def _trim_frames(trace: dict[str, Any]) -> dict[str, Any]:
    """``trace`` with stack frames kept on the newest entry of each process group only."""
    newest: dict[str, int] = {}
    entries = trace.get("entries", [])
    for i, entry in enumerate(entries):
        group = entry.get("process_group") or ["", ""]
        newest[str(group[0])] = i
    keep = set(newest.values())
    for i, entry in enumerate(entries):
        if i not in keep:
            entry.pop("frames", None)
    return trace


def _dump(function: Callable[..., bytes]) -> dict[str, Any]:
    raw = function(includeCollectives=True, includeStackTraces=True, onlyActive=False)
    trace = _plain(pickle.loads(raw))  # torch's own bytes, made in this process
    return _trim_frames(trace) if isinstance(trace, dict) else {}


#: backend -> torch's dump of its Flight Recorder (``nccl`` only where torch was built with NCCL)
DUMPERS: dict[str, str] = {"gloo": "_dump_fr_trace", "nccl": "_dump_nccl_trace"}


def flight_traces(dumpers: dict[str, Callable[..., bytes]] | None = None) -> dict[str, dict[str, Any]]:
    """What each backend's Flight Recorder holds in this process, by backend; stack frames kept on the newest entry
    of each group. ``dumpers`` replaces torch's dump functions (by default those of ``DUMPERS`` that exist)."""
    if dumpers is None:
        c10d_module = torch._C._distributed_c10d
        found = {backend: getattr(c10d_module, name, None) for backend, name in DUMPERS.items()}
        dumpers = {backend: function for backend, function in found.items() if function is not None}
    return {backend: _dump(function) for backend, function in dumpers.items()}


def python_stack(thread_id: int | None) -> str | None:
    """The Python stack of thread ``thread_id`` now, formatted as a traceback (None when it is gone)."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    return "".join(traceback.format_stack(frame)) if frame is not None else None


def write_atomically(path: Path, data: bytes, attempts: int = 3) -> None:
    """Write ``path`` through a temporary file renamed over it. The agent removes a directory it emptied: one
    removed between ``mkdir`` and the write is made again."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    for attempt in range(attempts):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            break
        except FileNotFoundError:
            if attempt == attempts - 1:
                raise
    os.replace(tmp, path)


class FlightRecorder:
    """Dumps of one rank's Flight Recorder: on the policy's ``dump_flight_recorder`` commands (``poll``), and when
    the watchdog asks (``dump``). Built on the training thread (its stack is the one dumped); used from one other.

    ``directory`` defaults to ``$OPSD_FLIGHT_DIR`` and ``policy_path`` to ``$OPSD_POLICY_FILE``; without a directory
    the dumps go to the agent at ``$OPSD_AGENT_HOST`` (and the policy comes from it); with neither nothing is
    dumped. Commands already in the policy when it is first read are older than this process
    (a relaunched rank finds the command of the incident that stopped its predecessor) and are not run."""

    def __init__(
        self,
        run: str,
        rank: int,
        world_size: int,
        *,
        directory: str | None = None,
        policy_path: str | None = None,
        tracer: CollectiveTracer = TRACER,
        host: str | None = None,
        dumpers: dict[str, Callable[..., bytes]] | None = None,
    ) -> None:
        """``dumpers``: torch's dump function of each backend's Flight Recorder (default: ``flight_traces``')."""
        self.run = run
        self.dumpers = dumpers
        self.rank = rank
        self.world_size = world_size
        self.host = host or socket.gethostname()
        self.tracer = tracer
        found = directory or os.environ.get(FLIGHT_DIR_ENV)
        self.directory = Path(found) if found else None
        agent = agent_from_env() if self.directory is None else None  # a pod without the host directory
        self.upload_url = agent.flight_url if agent is not None else None
        policy = policy_source(policy_path)
        self.policy = PolicyReader(policy) if policy and (self.directory or self.upload_url) else None
        self.training_thread = threading.get_ident()
        self.dumps = 0
        self.errors = 0
        self.policy_seen = False  # the policy was read once: commands that appear from now on are run
        self._warned = False

    def poll(self) -> list[Path | str]:
        """Run the dump commands of the policy not run before; the files written."""
        if self.policy is None:
            return []
        try:
            commands = self.policy.new_commands(self.rank)
        except Exception as exc:  # the reader does not raise; a broken one must not stop the watchdog either
            self._error(exc)
            return []
        if not self.policy_seen:
            self.policy_seen = True
            if commands:
                log.info("flight recorder: %d command(s) older than this process ignored", len(commands))
            return []
        written = []
        for command in commands:
            if command.name == DUMP_COMMAND:
                path = self.dump(command.id)
                if path is not None:
                    written.append(path)
        return written

    def dump(self, trigger: str) -> Path | str | None:
        """Write this rank's dump for ``trigger`` (or send it to the agent); its path (or the agent's URL), or None
        when there is nowhere to put it or it failed."""
        if self.directory is None and self.upload_url is None:
            return None
        try:
            started = time.perf_counter()
            traces = flight_traces(self.dumpers)
            trace = traces.get("gloo", {"entries": []})
            body: dict[str, Any] = {
                "v": DUMP_VERSION,
                "run": self.run,
                "trigger": path_part(trigger),
                "rank": self.rank,
                "world_size": self.world_size,
                "host": self.host,
                "time_unix_s": time.time(),
                "groups": process_groups(self.tracer),
                "stack": python_stack(self.training_thread),
                "trace": trace,
            }
            if "nccl" in traces:
                body["nccl_trace"] = traces["nccl"]
            data = json.dumps(body).encode()
            if self.directory is None:
                return self._send(data, trigger, started)
            path = self.directory / path_part(self.run) / path_part(trigger) / f"rank-{self.rank}.json"
            write_atomically(path, data)
            self.dumps += 1
            log.warning(
                "flight recorder of rank %d dumped for %s: %s entries, %s (%.2f s)",
                self.rank,
                trigger,
                ", ".join(f"{len(t.get('entries', []))} {backend}" for backend, t in sorted(traces.items())),
                path,
                time.perf_counter() - started,
            )
            return path
        except Exception as exc:
            self._error(exc)
            return None

    def _send(self, data: bytes, trigger: str, started: float) -> str:
        """POST a dump to the agent (from the watchdog thread, which may wait: the training thread does not)."""
        assert self.upload_url is not None
        request = urllib.request.Request(
            self.upload_url, data=data, method="POST", headers={"Content-Type": "application/json", **rank_headers()}
        )
        for attempt in range(1, SEND_ATTEMPTS + 1):
            try:
                with urllib.request.urlopen(request, timeout=30) as answer:
                    answer.read()
                break
            except urllib.error.HTTPError as exc:
                retry_after = exc.headers.get("Retry-After") if exc.code == 503 else None
                exc.close()
                if retry_after is None or not retry_after.isdigit() or attempt == SEND_ATTEMPTS:
                    raise
                time.sleep(min(float(retry_after), 5.0))  # the agent is taking in other ranks' dumps
        self.dumps += 1
        log.warning(
            "flight recorder of rank %d dumped for %s: %d bytes sent to %s (%.2f s)",
            self.rank,
            trigger,
            len(data),
            self.upload_url,
            time.perf_counter() - started,
        )
        return self.upload_url

    def _error(self, exc: BaseException) -> None:
        self.errors += 1
        if not self._warned:
            self._warned = True
            log.warning("flight recorder dump failed (counted, not raised): %r", exc)
