"""The costs of a checkpoint and of a recovery as this project measured them on its own runs.

Two runs give them (``python -m bench.goodput --measure`` runs both and rewrites ``bench/measured_costs.json``):

- ``python -m bench.checkpoint_stall``: 4 CPU ranks, about 800 MB of model and AdamW state. Kept: the checkpoint's
  bytes, the median blocking seconds of an asynchronous save (thread) and of its staging, and the median seconds of
  a synchronous save (every byte written, hashed and committed: the write rate).
- ``make demo`` (``python -m opsd.cli.demo``): 2 nodes x 2 ranks, an XID 79 injected on one node. Kept: the XID's
  detection delay (the injection to the incident), the controller's steps (the incident to the relaunch's
  launch, done: cordon, spare, stop, launch) and the ranks' start-up (the launch to the first productive step:
  process start, ``import torch``, process groups, model, restore, first step), from the demo's state store.

How they scale to a large job: ``bench.scale_model``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from opsd.controller.state import StateStore
from opsd.protocol.states import ActionKind, IncidentKind

DEFAULT_PATH = Path(__file__).with_name("measured_costs.json")
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Measured:
    # bench.checkpoint_stall
    checkpoint_bytes: float  # all ranks together
    checkpoint_ranks: int
    async_blocking_s: float  # median seconds an asynchronous save (thread) stopped training
    async_staging_s: float  # of which staging the state in memory
    sync_blocking_s: float  # median seconds of a synchronous save: every byte written, hashed, committed
    # make demo
    xid_detection_s: float  # the XID's injection to its incident
    controller_steps_s: float  # the incident to the relaunch's launch step done
    rank_startup_s: float  # that launch to the first productive step after the resume
    source: str  # where, when and on what the figures were taken

    def __post_init__(self) -> None:
        positive = {
            "checkpoint_bytes": self.checkpoint_bytes,
            "checkpoint_ranks": self.checkpoint_ranks,
            "async_blocking_s": self.async_blocking_s,
            "sync_blocking_s": self.sync_blocking_s,
            "rank_startup_s": self.rank_startup_s,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"measured costs: {name} must be > 0, not {value!r}")
        for name in ("async_staging_s", "xid_detection_s", "controller_steps_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"measured costs: {name} must be >= 0, not {getattr(self, name)!r}")
        if self.async_staging_s > self.async_blocking_s:
            raise ValueError("measured costs: async_staging_s is part of async_blocking_s: it cannot exceed it")

    @property
    def bytes_per_rank(self) -> float:
        return self.checkpoint_bytes / self.checkpoint_ranks

    @property
    def write_bytes_per_s_per_rank(self) -> float:
        """What one rank writes (and reads back) a second through opsd's checkpoint path, hashing included."""
        return self.bytes_per_rank / self.sync_blocking_s

    @property
    def relaunch_s(self) -> float:
        return self.controller_steps_s + self.rank_startup_s


def load(path: Path = DEFAULT_PATH) -> Measured:
    try:
        body = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"measured costs {path}: {exc}") from None
    if not isinstance(body, dict):
        raise ValueError(f"measured costs {path}: expected a JSON object")
    try:
        return Measured(**body)
    except TypeError as exc:
        raise ValueError(f"measured costs {path}: {exc}") from None


def save(measured: Measured, path: Path = DEFAULT_PATH) -> None:
    path.write_text(json.dumps(asdict(measured), indent=1) + "\n")


_STALL_LINES = {
    "mb": re.compile(r"checkpoint (\d+) MB over \w+ x (\d+) rank"),
    "sync": re.compile(r"opsd sync save: median ([\d.]+) s blocking"),
    "thread": re.compile(r"async save \(thread\): median ([\d.]+) s blocking, of which ([\d.]+) s staging"),
}


def parse_checkpoint_stall(text: str) -> dict[str, float]:
    """The figures ``bench.checkpoint_stall`` prints; ValueError naming the line it could not find."""
    found = {}
    for name, pattern in _STALL_LINES.items():
        match = pattern.search(text)
        if match is None:
            raise ValueError(f"bench.checkpoint_stall printed no line matching {pattern.pattern!r}")
        found[name] = match
    return {
        "checkpoint_bytes": float(found["mb"].group(1)) * 1e6,
        "checkpoint_ranks": int(found["mb"].group(2)),
        "async_blocking_s": float(found["thread"].group(1)),
        "async_staging_s": float(found["thread"].group(2)),
        "sync_blocking_s": float(found["sync"].group(1)),
    }


def demo_costs(workdir: Path, run: str = "demo") -> dict[str, float]:
    """The XID incident's delays, from the demo's state store: detection, the controller's steps, the start-up."""
    store = StateStore.open(f"sqlite:///{workdir / 'state' / 'opsd.db'}")
    incidents = [i for i in store.incidents(run) if i.kind == IncidentKind.FATAL_XID and i.resumed_s]
    if not incidents:
        raise ValueError(f"the demo in {workdir} has no recovered XID incident")
    incident = incidents[0]
    resumed_s = incident.resumed_s
    assert resumed_s is not None
    launches = [a for a in store.actions(run=run, incident_id=incident.id) if a.kind == ActionKind.LAUNCH]
    if not launches or launches[-1].done_s is None:
        raise ValueError(f"the XID incident of the demo in {workdir} has no completed launch")
    launched_s = launches[-1].done_s
    return {
        "xid_detection_s": round(incident.detected_s - incident.failed_s, 3),
        "controller_steps_s": round(launched_s - incident.detected_s, 3),
        "rank_startup_s": round(resumed_s - launched_s, 3),
    }


def measure() -> Measured:
    """Runs ``bench.checkpoint_stall`` and the demo, one after the other (a few minutes on 2 cores)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    stall = subprocess.run(
        [sys.executable, "-m", "bench.checkpoint_stall"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if stall.returncode != 0:
        raise RuntimeError(f"bench.checkpoint_stall failed ({stall.returncode}): {stall.stderr[-2000:]}")
    figures: dict[str, float] = parse_checkpoint_stall(stall.stdout)
    with tempfile.TemporaryDirectory() as tmp:
        demo = subprocess.run(
            [sys.executable, "-m", "opsd.cli.demo", "--workdir", tmp],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        if demo.returncode != 0:
            raise RuntimeError(f"the demo failed ({demo.returncode}): {demo.stdout[-2000:]}{demo.stderr[-2000:]}")
        figures.update(demo_costs(Path(tmp)))
    load_1m = os.getloadavg()[0]  # the machine may be shared: the figures are only as quiet as it was
    source = (
        f"bench.checkpoint_stall and make demo, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores "
        f"(load average {load_1m:.1f} at the end), {_commit()}"
    )
    return Measured(**figures, source=source)  # type: ignore[arg-type]


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return f"commit {out.stdout.strip()}" if out.returncode == 0 else "no git commit"
