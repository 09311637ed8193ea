"""Fault injection into a local run, for real: an XID appended to a node's fake GPU source (its agent reports it),
SIGKILL, SIGSTOP (a hang), or a SIGSTOP/SIGCONT duty cycle that slows a rank down by a factor."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

from opsd.backends.local.processes import RankProcess
from opsd.backends.local.spec import LocalRunSpec
from opsd.controller.port import Fault, FaultKind
from opsd.errors import BodyError
from opsd.protocol.gpu_files import inject_xid


class Injector:
    """Injects faults into the nodes and ranks of one local run; slowdowns run until ``release``."""

    def __init__(self, spec: LocalRunSpec) -> None:
        self.spec = spec
        self.slowdowns: dict[int, threading.Event] = {}

    def inject(self, fault: Fault, nodes: set[str], ranks: list[RankProcess]) -> str:
        """Inject ``fault`` (``nodes``: the nodes with an agent; ``ranks``: the current launch's); what was done, in
        words. ``BodyError`` when it names no such node or running rank."""
        if fault.kind is FaultKind.XID:
            if fault.node not in nodes:
                raise BodyError(f"no node {fault.node!r}")
            inject_xid(self.spec.node_dir(fault.node) / "gpus", fault.gpu, fault.xid)
            return f"XID {fault.xid} on {fault.node} GPU {fault.gpu}"
        target = next((r for r in ranks if r.rank == fault.rank and r.proc.poll() is None), None)
        if target is None:
            raise BodyError(f"no running rank {fault.rank}")
        pid = target.proc.pid
        if fault.kind is FaultKind.KILL:
            os.kill(pid, signal.SIGKILL)
            return f"rank {fault.rank} (pid {pid}) killed"
        if fault.kind is FaultKind.HANG:
            os.kill(pid, signal.SIGSTOP)
            return f"rank {fault.rank} (pid {pid}) stopped (SIGSTOP)"
        if fault.factor <= 1:
            raise BodyError("--factor must be > 1")
        stop = threading.Event()
        self.slowdowns[fault.rank] = stop
        threading.Thread(target=duty_cycle, args=(pid, fault.factor, stop), daemon=True).start()
        return f"rank {fault.rank} slowed down {fault.factor}x (SIGSTOP/SIGCONT duty cycle)"

    def release(self) -> None:
        """End every slowdown (before the ranks are stopped)."""
        for event in self.slowdowns.values():
            event.set()
        self.slowdowns.clear()


def duty_cycle(pid: int, factor: float, stop: threading.Event, period_s: float = 0.1) -> None:
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
