"""``make demo-ft``: healthy replicas keep training while opsd swaps a failed replica group's node, in a few minutes.

A controller with the local backend runs the reference trainer on torchft (``--ft``, docs/ft.md): 2 replica groups
(``dp_replicate=2``) of 2 ranks (``dp_shard=2``), one node each, and a spare node; the backend runs the Lighthouse
beside the controller. At step ``--inject-at`` group 1's GPU falls off the bus: its ranks hang in the step, their
connections left open (``examples.ft.wedge``: what a dead NCCL peer is to its survivors, who wait in their
cross-group all-reduce until its timeout, 60 s), and an XID 79 is injected on node-1. The controller names group 1
failed in the run's policy, and group 0 abandons the collective at once (``trainer_hooks.integrations.torchft``); it
quarantines node-1, brings the spare in, stops and relaunches group 1 alone; group 0 trains on with a smaller quorum,
and group 1 heals from it (no checkpoint is read) and joins again. Once group 1 is back, the demo
lets the run train ``--after-heal`` more steps and end (``--steps-file``), and checks what the replicas hold.

Printed: a summary in words, then, last, one JSON line, each figure from the trainers' own records (their
``--losses-out``) and the controller's:

- ``survivor_discarded_steps``: steps group 0 did not commit (their update thrown away, their batch done again: the
  step in flight when its collective failed with group 1's node), and ``survivor_stall_s``: its longest time
  between two committed steps from the injection until group 1 was back;
- ``checkpoint_reads``: checkpoints read by a group relaunched alone (0: group 1 healed from group 0);
  ``whole_job_restarts``: relaunches of the whole job, over every incident of the run;
- ``heal_s`` (from group 1's relaunch to its first step in the quorum), split into ``heal_transfer_s`` (fetching and
  loading group 0's state) and ``heal_startup_s`` (the rest: process start, imports, the model, the quorum);
  ``recovered_s`` (from the injection to then);
- ``incidents``: each failure's kind, replica group and the step its group healed to (None: not back);
- ``replicas_equal`` (the two groups' final weights and optimizer states are the same, bit for bit),
  ``final_step``, the ETTR, and the incidents' records (their ``lost_steps``, summed: group 0's discarded steps).

``--then-kill`` adds a second failure once group 1 is back: a rank of group 1 is killed; group 1 is relaunched alone
once more and heals from group 0 again (``tests/test_demo_ft.py`` runs it so: a hung group and a killed group).

It exits 1, saying on stderr why, when a whole-job restart happened, a group relaunched alone read a checkpoint,
group 0's stall passed ``STALL_BOUND_S`` (the Lighthouse's heartbeat timeout and 5 s: group 0's step in flight is
abandoned when opsd names group 1 failed, its next quorum waits until the Lighthouse counts group 1 dead, then it
trains alone; without opsd's word it would wait for its collective's timeout),
the replicas differ, or the run did not complete.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opsd.backends.local.backend import LocalBackend, effects
from opsd.backends.local.spec import LocalRunSpec
from opsd.cli.demo_run import checkpoint_url, finish, fresh_workdir, run_spec, serve_config
from opsd.controller.controller import Controller
from opsd.controller.port import Fault, FaultKind
from opsd.protocol.ft import LighthouseConfig, ManagerTimeouts
from opsd.protocol.states import FAILURE_KINDS, IncidentKind, RunState
from opsd.runtime.local import run_local

RUN = "demo-ft"
#: the rank ``--then-kill`` kills: group 1's first (its ranks are 2 and 3)
KILLED_RANK = 2
#: the bound on group 0's longest time between two committed steps around the failure
STALL_BOUND_S = LighthouseConfig().heartbeat_timeout_ms / 1000 + 5.0


def trainer_command(ckpt_url: str, losses: Path, steps_file: Path, wedge_at: int, wedged: Path) -> tuple[str, ...]:
    return (
        *(sys.executable, "-m", "examples.train", "--ft", "--mesh", "dp_replicate=2,dp_shard=2"),
        *("--steps", "100000", "--steps-file", str(steps_file), "--opsd-monitor"),
        *("--ckpt-dir", ckpt_url, "--ckpt-every", "25", "--resume"),
        *("--losses-out", str(losses.with_name("losses-{replica_group}.json"))),
        *("--ft-wedge-at-step", str(wedge_at), "--ft-wedge-group", "1", "--ft-wedge-file", str(wedged)),
    )


class Scenario:
    """From the runner's poll loop: the XID once group 1 wedged (its ranks touch ``wedged``), then the run's last
    step once group 1 is back in the quorum (``after_heal`` steps later). With ``then_kill``, a rank of group 1 is
    killed (SIGKILL) once group 1 is back, and the last step is set once it is back again (healed once more)."""

    def __init__(self, steps_file: Path, wedged: Path, after_heal: int, then_kill: bool = False) -> None:
        self.steps_file = steps_file
        self.wedged = wedged
        self.after_heal = after_heal
        self.then_kill = then_kill
        self.injected_s: float | None = None
        self.killed_s: float | None = None
        self.step_at_injection = 0
        self.last_step: int | None = None

    def __call__(self, controller: Controller, backend: LocalBackend, now_s: float) -> None:
        status = controller.status(RUN, now_s)
        if status is None:
            return
        if self.injected_s is None:
            if self.wedged.exists():
                print(f"group 1 wedged; injecting XID 79 on node-1 at step {status.step}", flush=True)
                if backend.inject(RUN, Fault(FaultKind.XID, node="node-1", gpu=0, xid=79), "demo-ft-xid").ok:
                    self.injected_s, self.step_at_injection = time.time(), status.step
            return
        if self.last_step is not None or self._back(controller) < 1:
            return
        if self.then_kill and self.killed_s is None:
            print(f"replica group 1 is back; killing its rank {KILLED_RANK} at step {status.step}", flush=True)
            if backend.inject(RUN, Fault(FaultKind.KILL, rank=KILLED_RANK), "demo-ft-kill").ok:
                self.killed_s = time.time()
            return
        if self.then_kill and self._back(controller) < 2:
            return
        self.last_step = status.step + self.after_heal
        self.steps_file.write_text(str(self.last_step))
        print(f"replica group 1 is back: the run ends at step {self.last_step}", flush=True)

    @staticmethod
    def _back(controller: Controller) -> int:
        """How many of replica group 1's recoveries are over: the group back in the quorum."""
        incidents = [i for i in controller.store.incidents(RUN) if i.replica_group == 1]
        return sum(1 for i in incidents if i.resumed_s is not None and i.resumed_from_step is not None)


def longest_gap(times_s: list[float], start_s: float, end_s: float) -> float | None:
    """The longest time between two consecutive ``times_s`` over the gaps that overlap [``start_s``, ``end_s``]; None
    without two times."""
    gaps = [b - a for a, b in itertools.pairwise(sorted(times_s)) if b >= start_s and a <= end_s]
    return max(gaps) if gaps else None


def summary(status: dict[str, Any], spec: LocalRunSpec, scenario: Scenario, losses: Path) -> dict[str, Any]:
    incidents = [i for i in status["incidents"] if i["kind"] in FAILURE_KINDS]
    first = incidents[0] if incidents else None
    launch = next(
        (a for a in status["actions"] if first and a["incident_id"] == first["id"] and a["kind"] == "launch"), None
    )
    relaunches = [e for e in effects(spec) if e["step"] == "relaunch"]
    relaunched = sorted({e.get("group") for e in relaunches} - {None}, key=str)
    reports = [json.loads(losses.with_name(f"losses-{g}.json").read_text()) for g in (0, 1)]
    survivor, healed = reports
    hashes = [r.get("state_hashes") for r in reports]
    injected, resumed = scenario.injected_s, first["resumed_s"] if first else None
    heal_s = round(resumed - launch["done_s"], 3) if resumed and launch and launch["done_s"] else None
    transfer_s = round(float(healed.get("healing_s", 0.0)), 3)
    stall_s = longest_gap(survivor.get("commit_times_unix_s", []), injected, resumed) if injected and resumed else None
    return {
        "run": status["run"],
        "state": status["state"],
        "incident": first["kind"] if first else None,
        "replica_group": first["replica_group"] if first else None,
        "incidents": [[i["kind"], i["replica_group"], i["resumed_from_step"]] for i in incidents],
        "groups_relaunched": relaunched,
        "whole_job_restarts": sum(1 for e in relaunches if e.get("group") is None and e["generation"] > 1),
        "checkpoint_reads": sum(1 for r in reports if r.get("checkpoint_read")),
        "survivor_discarded_steps": survivor.get("discarded_steps"),
        "survivor_stall_s": round(stall_s, 3) if stall_s is not None else None,
        "missed_steps": first["missed_steps"] if first else None,
        "lost_steps": sum(i["lost_steps"] or 0 for i in incidents) if first else None,
        "healed_to_step": first["resumed_from_step"] if first else None,
        "heal_s": heal_s,
        "heal_transfer_s": transfer_s,
        "heal_startup_s": round(heal_s - transfer_s, 3) if heal_s is not None else None,
        "recovered_s": round(resumed - injected, 3) if resumed and injected else None,
        "replicas_equal": bool(hashes[0]) and hashes[0] == hashes[1],
        "spare": first["spare"] if first else None,
        "final_step": status["step"],
        "ettr": round(status["ettr"], 4),
        "badput_s": {bucket: round(v, 3) for bucket, v in status["badput_s"].items()},
    }


def shortfalls(result: dict[str, Any], scenario: Scenario) -> list[str]:
    missing = []
    if scenario.injected_s is None:
        missing.append("no fault was injected")
    if result["incident"] != IncidentKind.FATAL_XID or result["replica_group"] != 1:
        missing.append(f"the XID was not recovered in replica group 1 alone (incident: {result['incident']})")
    if result["groups_relaunched"] != [1]:
        missing.append(f"groups relaunched: {result['groups_relaunched']} (group 1 alone was to be)")
    back = [i[:2] for i in result["incidents"] if i[2] is not None]  # (kind, group) of the recoveries healed
    if scenario.then_kill and [IncidentKind.PROCESS_EXIT, 1] not in back:
        missing.append(f"the killed rank's group 1 was not recovered alone and back (incidents: {result['incidents']})")
    if result["healed_to_step"] is None:
        missing.append("replica group 1 never stepped in the quorum again")
    if result["whole_job_restarts"]:
        missing.append(f"the whole job was restarted {result['whole_job_restarts']} time(s)")
    if result["checkpoint_reads"]:
        missing.append(f"{result['checkpoint_reads']} group(s) relaunched alone read a checkpoint (a peer was live)")
    stall = result["survivor_stall_s"]
    if stall is None or stall > STALL_BOUND_S:
        missing.append(f"group 0's longest time between two committed steps was {stall} s (bound {STALL_BOUND_S} s)")
    if not result["replicas_equal"]:
        missing.append("the replica groups' final states differ")
    if result["state"] != RunState.COMPLETED:
        missing.append(f"the run did not complete: it is {result['state']} at step {result['final_step']}")
    return missing


def run_demo(
    workdir: Path,
    inject_at: int,
    after_heal: int,
    timeout_s: float,
    *,
    trainer_args: Sequence[str] = (),
    ft_timeouts: ManagerTimeouts | None = None,
    hang_floor_s: float = 20.0,
    then_kill: bool = False,
) -> tuple[dict[str, Any], Scenario]:
    """The demo's run in ``workdir`` (empty), ``trainer_args`` added to the trainer's; its figures and scenario."""
    ckpt_url, losses, steps_file = checkpoint_url(workdir), workdir / "losses.json", workdir / "last-step"
    config = serve_config(workdir, heartbeat_floor_s=3.0, hang_floor_s=hang_floor_s)
    wedged = workdir / "wedged"
    command = (*trainer_command(ckpt_url, losses, steps_file, inject_at, wedged), *trainer_args)
    spec = run_spec(RUN, config, workdir, command, replica_groups=2, ft_timeouts=ft_timeouts or ManagerTimeouts())
    scenario = Scenario(steps_file, wedged, after_heal, then_kill)
    where = f"http://127.0.0.1:{config.port}"
    print(f"opsd demo-ft: controller on {where}, 2 replica groups x 2 ranks + 1 spare", flush=True)
    status = run_local(config, spec, timeout_s=timeout_s, on_poll=scenario)
    return summary(status, spec, scenario, losses), scenario


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m opsd.cli.demo_ft", description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default=".opsd-demo-ft", help="state, checkpoints and logs (emptied first)")
    p.add_argument("--inject-at", type=int, default=30, help="the step in which group 1 hangs and its XID comes")
    p.add_argument("--after-heal", type=int, default=20, help="steps the run makes once group 1 is back")
    p.add_argument(
        "--then-kill",
        action="store_true",
        help="then kill a rank of group 1 once it is back: it is relaunched alone once more and heals again",
    )
    p.add_argument("--timeout-s", type=float, default=170.0)
    args = p.parse_args(argv)
    if args.inject_at < 1 or args.after_heal < 1 or args.timeout_s <= 0:
        p.error("--inject-at and --after-heal must be >= 1, --timeout-s > 0")
    workdir = fresh_workdir(args.workdir)
    result, scenario = run_demo(workdir, args.inject_at, args.after_heal, args.timeout_s, then_kill=args.then_kill)
    print()
    print(f"run {result['run']}: {result['state']} at step {result['final_step']}")
    if scenario.injected_s is not None:
        print(
            f"  group 1 wedged, XID 79 on node-1 at step {scenario.step_at_injection}; replica group 1 alone swapped to"
            f" {result['spare']} and relaunched; group 0 trained on ({result['survivor_discarded_steps']} steps"
            f" discarded, {result['survivor_stall_s']} s at most between two committed steps); group 1 healed to step"
            f" {result['healed_to_step']} {result['heal_s']} s after its relaunch ({result['heal_transfer_s']} s of"
            f" it fetching and loading group 0's state, {result['checkpoint_reads']} checkpoints read,"
            f" {result['missed_steps']} steps missed), {result['recovered_s']} s after the injection;"
            f" whole-job restarts: {result['whole_job_restarts']}; replicas equal: {result['replicas_equal']}"
        )
    return finish("opsd demo-ft", result, workdir, shortfalls(result, scenario))


if __name__ == "__main__":
    sys.exit(main())
