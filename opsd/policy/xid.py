"""What an NVIDIA XID error means for a training job: pure classification, no I/O, no clocks.

Actions (``opsd/data/xid_actions.csv``, from NVIDIA's XID catalog and the lists GKE, EKS, Azure HPC health checks
and the Kubernetes device plugin use):

- ``cordon_and_swap``: a hardware fault. Take the node out of the job, bring a spare in.
- ``restart_job``: an application-level error. Restart the job on the same nodes.
- ``watch_window``: benign alone, a fault when frequent: escalates to ``cordon_and_swap`` when more than
  ``threshold`` events of that GPU fall within ``window_s`` (e.g. single-bit ECC storms, XID 92).

An XID missing from the table is treated as ``watch_window``: counted and escalated if it repeats, never ignored.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from opsd.protocol.xid_table import XidAction


@dataclass(frozen=True)
class XidEvent:
    gpu: int
    xid: int
    time_s: float


@dataclass(frozen=True)
class WatchWindow:
    window_s: float = 3600.0
    threshold: int = 3  # escalate when more than this many events fall in the window

    def __post_init__(self) -> None:
        if self.window_s <= 0:
            raise ValueError("xid.window_s must be > 0")
        if self.threshold < 0:
            raise ValueError("xid.threshold must be >= 0")


@dataclass(frozen=True)
class XidDecision:
    gpu: int
    xid: int
    action: XidAction
    reason: str


def classify(xid: int, table: Mapping[int, XidAction]) -> XidAction:
    return table.get(xid, XidAction.WATCH_WINDOW)


def decide(
    event: XidEvent, history: Iterable[XidEvent], table: Mapping[int, XidAction], window: WatchWindow
) -> XidDecision | None:
    """What to do about ``event`` given earlier events (any GPU, any time; ``event`` itself excluded).

    None when the event only needs counting: a ``watch_window`` XID still within its budget.
    """
    action = classify(event.xid, table)
    if action is not XidAction.WATCH_WINDOW:
        return XidDecision(event.gpu, event.xid, action, f"xid {event.xid} is {action.value}")
    start = event.time_s - window.window_s
    recent = 1 + sum(
        1
        for e in history
        if e.gpu == event.gpu and classify(e.xid, table) is XidAction.WATCH_WINDOW and start < e.time_s <= event.time_s
    )
    if recent > window.threshold:
        within = f"within {window.window_s:g} s (threshold {window.threshold})"
        reason = f"{recent} watch-window xids on gpu {event.gpu} {within}"
        return XidDecision(event.gpu, event.xid, XidAction.CORDON_AND_SWAP, reason)
    return None
