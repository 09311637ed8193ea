"""What ``make demo`` and ``make demo-ft`` share: a workdir emptied first, the logging, a controller with the local
backend on a free port and quick detection, a local run of 2 nodes x 2 ranks and a spare, and the closing lines (the
badput in words, the JSON line, the shortfalls on stderr and the exit code)."""

from __future__ import annotations

import json
import logging
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opsd.backends.local.processes import listen_port
from opsd.backends.local.spec import LocalRunSpec
from opsd.controller.config import ControllerConfig
from opsd.policy.detection import DetectionConfig
from opsd.runtime.config import ServeConfig

QUIET = ("httpx", "uvicorn", "opsd.controller.state", "opsd.controller.scoring")


def fresh_workdir(path: str) -> Path:
    """The demo's logging, and its workdir, emptied first."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    for noisy in QUIET:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    workdir = Path(path).resolve()
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    return workdir


def serve_config(
    workdir: Path, *, flight_wait_s: float = ControllerConfig.flight_wait_s, **detection: float
) -> ServeConfig:
    """A controller on a free port (its liveness datagrams and its heartbeat process too), its state in the
    workdir, a detection pass every 0.25 s with the floors given in ``detection`` (``DetectionConfig``'s fields)."""
    controller = ControllerConfig(detection=DetectionConfig(**detection), flight_wait_s=flight_wait_s)
    return ServeConfig(
        port=listen_port(),
        liveness_port=0,
        heartbeat_port=0,
        state_dir=str(workdir / "state"),
        tick_interval_s=0.25,
        controller=controller,
    )


def run_spec(
    run: str,
    config: ServeConfig,
    workdir: Path,
    command: Sequence[str],
    *,
    gpus_per_node: int = 2,
    spares: int = 1,
    **extra: Any,
) -> LocalRunSpec:
    """A run of 2 nodes under the controller of ``config`` (the demos': 2 ranks each and a spare), checkpoints in
    the workdir."""
    return LocalRunSpec(
        run=run,
        command=tuple(command),
        nodes=2,
        gpus_per_node=gpus_per_node,
        spares=spares,
        workdir=str(workdir / "runs"),
        controller_url=f"http://127.0.0.1:{config.port}/v1/heartbeat",
        checkpoint_url=checkpoint_url(workdir),
        **extra,
    )


def checkpoint_url(workdir: Path) -> str:
    return f"file://{workdir / 'ckpt'}"


def finish(name: str, result: dict[str, Any], workdir: Path, missing: Sequence[str]) -> int:
    """The closing lines: the badput, the JSON line (last on stdout), what fell short on stderr; 1 if anything did."""
    badput = ", ".join(f"{bucket} {v:.1f} s" for bucket, v in result["badput_s"].items() if v > 0) or "none"
    print(f"  ETTR {result['ettr']:.3f} (badput: {badput}); state, checkpoints and logs in {workdir}")
    print(json.dumps(result), flush=True)
    for reason in missing:
        print(f"{name} failed: {reason}", file=sys.stderr, flush=True)
    return 1 if missing else 0
