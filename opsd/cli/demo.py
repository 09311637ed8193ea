"""``make demo``: the main job end to end on this machine, in about two minutes.

A controller with the local backend runs the reference trainer on 2 nodes x 2 ranks (``dp_shard=2,tp=2``) with a
hot spare, hooks on and asynchronous checkpoints every 10 steps. Once a checkpoint is committed and training has
gone past it, an XID 79 (GPU fallen off the bus) is injected on node-1. The controller detects it, stops the
ranks, cordons node-1, brings the spare in, relaunches, and the ranks resume from the newest committed
checkpoint; the run completes. Printed: a summary in words, then, last, one JSON line. With
``OTEL_EXPORTER_OTLP_ENDPOINT`` set, the incident is exported as a trace (docs/tracing.md) and its id printed.

It exits 0 only when the fault was injected, its incident detected and recovered from, and the run completed; else
it says on stderr what did not happen and exits 1. ``--no-inject`` leaves the fault out (the demo then fails: a check
that its exit status means something).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opsd.backends.local.backend import LocalBackend
from opsd.checkpoints.layout import inspect_checkpoints
from opsd.checkpoints.store import open_store
from opsd.cli.demo_run import checkpoint_url, finish, fresh_workdir, run_spec, serve_config
from opsd.controller.controller import Controller
from opsd.controller.port import Fault, FaultKind
from opsd.protocol.states import FAILURE_KINDS, IncidentKind, NodeRole, RunState
from opsd.runtime.local import run_local

RUN = "demo"


def trainer_command(ckpt_url: str, steps: int, losses: Path) -> tuple[str, ...]:
    return (
        sys.executable,
        "-m",
        "examples.train",
        "--mesh",
        "dp_shard=2,tp=2",
        "--steps",
        str(steps),
        "--opsd-monitor",
        "--ckpt-dir",
        ckpt_url,
        "--ckpt-every",
        "10",
        "--resume",
        "--losses-out",
        str(losses),
    )


class Injector:
    """Injects the XID once a checkpoint at or after ``after_checkpoint`` is committed and training is past it."""

    def __init__(self, ckpt_url: str, after_checkpoint: int, node: str) -> None:
        self.store = open_store(ckpt_url)
        self.after_checkpoint = after_checkpoint
        self.node = node
        self.injected_s: float | None = None
        self.step_at_injection = 0

    def __call__(self, controller: Controller, backend: LocalBackend, now_s: float) -> None:
        if self.injected_s is not None:
            return
        status = controller.status(RUN, now_s)
        committed = [c.step for c in inspect_checkpoints(self.store) if c.problem is None]
        if status and committed and max(committed) >= self.after_checkpoint and status.step >= max(committed) + 3:
            print(f"injecting XID 79 on {self.node} GPU 0 at step {status.step}", flush=True)
            outcome = backend.inject(RUN, Fault(FaultKind.XID, node=self.node, gpu=0, xid=79), "demo-xid")
            if not outcome.ok:
                return  # the node is not there yet: again at the next poll
            self.injected_s = time.time()
            self.step_at_injection = status.step


def summary(status: dict[str, Any], injector: Injector) -> dict[str, Any]:
    failures = [i for i in status["incidents"] if i["kind"] in FAILURE_KINDS]
    xids = [i for i in failures if i["kind"] == IncidentKind.FATAL_XID]
    first = (xids or failures or [None])[0]  # the injected XID's incident, else the first failure
    injected = injector.injected_s
    since = first is not None and injected is not None  # the delays: from the injection
    return {
        "run": status["run"],
        "state": status["state"],
        "incident": first["kind"] if first else None,
        "recovered": bool(first and first["resumed_s"] is not None),
        "detected_s": round(first["detected_s"] - injected, 3) if since else None,
        "recovered_s": round(first["resumed_s"] - injected, 3) if since and first["resumed_s"] else None,
        "lost_steps": first["lost_steps"] if first else 0,
        "nodes_swapped": sum(1 for n in status["nodes"] if n["role"] == NodeRole.CORDONED),
        "spare": first["spare"] if first else None,
        "resumed_from_step": first["resumed_from_step"] if first else None,
        "trace_id": first.get("trace_id") if first else None,  # with OTEL_EXPORTER_OTLP_ENDPOINT set
        "final_step": status["step"],
        "ettr": round(status["ettr"], 4),
        "badput_s": {bucket: round(v, 3) for bucket, v in status["badput_s"].items()},
    }


def shortfalls(result: dict[str, Any], injector: Injector) -> list[str]:
    """What the demo was to show and did not: the fault injected, its incident detected and recovered from, the
    run completed."""
    missing = []
    if injector.injected_s is None:
        missing.append("no fault was injected")
    if result["incident"] is None:
        missing.append("no incident was detected")
    elif result["incident"] != IncidentKind.FATAL_XID:
        missing.append(f"the XID 79 was not detected (the first incident: {result['incident']})")
    elif not result["recovered"]:
        missing.append(f"the {result['incident']} incident was not recovered from (no productive step after it)")
    if result["state"] != RunState.COMPLETED:
        missing.append(f"the run did not complete: it is {result['state']} at step {result['final_step']}")
    return missing


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m opsd.cli.demo", description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default=".opsd-demo", help="state, checkpoints and logs (emptied first)")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--timeout-s", type=float, default=280.0)
    p.add_argument(
        "--no-inject", action="store_true", help="inject no fault (the demo then exits 1: nothing was recovered from)"
    )
    args = p.parse_args(argv)
    if args.steps < 1 or args.timeout_s <= 0:
        p.error("--steps must be >= 1 and --timeout-s > 0")
    workdir = fresh_workdir(args.workdir)
    ckpt_url = checkpoint_url(workdir)
    config = serve_config(workdir, heartbeat_floor_s=3.0, hang_floor_s=10.0)
    port = config.port
    spec = run_spec(RUN, config, workdir, trainer_command(ckpt_url, args.steps, workdir / "losses.json"))
    injector = Injector(ckpt_url, after_checkpoint=20, node="node-1")
    print(
        f"opsd demo: controller on http://127.0.0.1:{port}, 2 nodes x 2 ranks + 1 spare, {args.steps} steps", flush=True
    )
    status = run_local(config, spec, timeout_s=args.timeout_s, on_poll=None if args.no_inject else injector)
    result = summary(status, injector)
    print()
    print(f"run {result['run']}: {result['state']} at step {result['final_step']}")
    if result["incident"] and injector.injected_s is not None:
        print(
            f"  XID 79 injected on node-1 at step {injector.step_at_injection};"
            f" detected after {result['detected_s']} s;"
            f" {result['nodes_swapped']} node cordoned, {result['spare']} brought in;"
            f" resumed from step {result['resumed_from_step']} ({result['lost_steps']} steps redone);"
            f" first productive step {result['recovered_s']} s after the injection"
        )
    if result["trace_id"]:
        print(f"  trace id {result['trace_id']}: the incident's timeline, in Jaeger or Tempo")
    return finish("opsd demo", result, workdir, shortfalls(result, injector))


if __name__ == "__main__":
    sys.exit(main())
