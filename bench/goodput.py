"""Goodput of Llama 3 405B's workload under opsd's policies at costs it measured: ``python -m bench.goodput``.

The workload: Llama 3's 466 interruptions in 54 days on 16,384 GPUs: 419 unexpected, with the paper's cause mix
(Table 5), and 47 planned. Every policy sees the same failures (the same seeds). Printed, side by side:

- the costs: those this project measured (``bench/measured_costs.json``: ``bench.checkpoint_stall`` and the demo),
  scaled to 16,384 GPUs by the model of ``bench.scale_model`` (which parts grow with the job, and why);
- (a) the policies alone, at equal costs: a reconstruction of the practice the paper describes (docs/simulation.md:
  a checkpoint every 10 minutes, faults found by a 5-minute collective timeout), opsd's cadence alone, opsd's
  detection alone, and both; once at the practice's costs (a 10 s synchronous save, a 300 s restart), once at the
  measured costs. Both sides have the same spare pool;
- (b) what each cost is worth: the ETTR lost per extra minute of relaunch, per extra second of blocking save, per
  extra minute of detection (every signal a detector sees), at the measured costs;
- (c) opsd at the measured costs, the best fixed interval of a sweep (known only after the fact) at the same costs,
  and the practice at its own costs;
- (d) fault-tolerant replica groups (docs/ft.md) beside the checkpoint restart of (c), on the same failures, on NCCL:
  a failed group holds the others' collective until opsd's word reaches them (its detection and ``SIGNAL_S``) or,
  untold, until torchft's collective timeout; then the quorum without it (the stall ``bench.ft_recovery``
  measured, ``bench/ft_costs.json``) and a new communicator (``COMMUNICATOR_REBUILD_S``, assumed); the group's
  relaunch and heal at the scaled relaunch's cost (its start-up and communicators as the whole job's, the heal's
  transfer at the restore's rate: no cheaper than a restart), then at the heal measured here; its return stalls
  every group for its state's transfer (``HEAL_TRANSFER_S``) and a new communicator; a network failure takes nodes
  of several groups (a switch serves nodes the groups do not keep together) and restarts the whole job.

``--measure`` runs ``bench.checkpoint_stall`` and the demo first (a few minutes) and rewrites the costs file.
Last lines: ``adaptive_vs_best_fixed=<lost GPU-hours of opsd over those of the best fixed interval>``, then
``ettr_llama3_16k=<ETTR of opsd at the measured costs>`` (the paper reports over 0.90).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

from bench import measured_costs
from bench.scale_model import Job, Scaled, scale
from opsd.analysis.presets import DETECTION, Detection, Workload, presets
from opsd.analysis.simulation import Costs, Policy, Result, Scenario, log_grid, simulate, sweep

#: the reconstructed practice's costs (docs/simulation.md): a synchronous 10 s save, a 5-minute restart of the job
PRACTICE_COSTS = Costs(checkpoint_blocking_s=10.0, checkpoint_background_s=0.0, restart_s=300.0, repair_h=24.0)
PRACTICE_INTERVAL_S = 600.0
#: ``bench.ft_recovery``'s medians on this machine; the Lighthouse heartbeat timeout of docs/ft.md's defaults
FT_COSTS = Path(__file__).with_name("ft_costs.json")
FT_HEARTBEAT = "heartbeat_timeout_2000ms"
FT_GROUPS = (2, 8, 32)
#: opsd's word to the other groups after a detection: the policy in a heartbeat's reply (the agents beat every
#: second at scale), the rank's poll of its file (0.1 s); ``bench.ft_abort`` measured the whole stall here
SIGNAL_S = 1.0
#: a new NCCL communicator across the groups at each quorum change: assumed, not measured here (no GPU)
COMMUNICATOR_REBUILD_S = 5.0
#: a rejoining group reads its state from a peer, the others' collective waiting: Llama 3 405B's weights and AdamW
#: state (12 bytes a parameter) over the 2,048 ranks of one of 8 groups, 2.4 GB a rank, at an assumed 1 GB/s a rank
#: (torchft's HTTP transport, from host memory)
HEAL_TRANSFER_S = 405e9 * 12 / 2048 / 1e9


def ft_measured(path: Path = FT_COSTS) -> tuple[float, float, str]:
    """(the survivors' stall, a restarted group's heal, where from) as ``bench.ft_recovery`` measured them."""
    try:
        body = json.loads(path.read_text())
        at = body[FT_HEARTBEAT]
        return float(at["stall_s"]), float(at["heal_s"]), str(body.get("source", path))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not bench.ft_recovery's medians: {exc}") from None


def lost_gpu_hours(result: Result, gpus: int) -> float:
    return (result.wall_s - result.productive_s) * gpus / 3600.0


def policies(opsd_detection: Detection) -> list[tuple[str, Policy]]:
    """The practice, then opsd's policies one at a time, then both."""
    watchdog = DETECTION["watchdog"]
    return [
        ("practice: every 10 min, 5-min timeout", Policy(interval_s=PRACTICE_INTERVAL_S, detection=watchdog)),
        ("opsd's cadence only", Policy(detection=watchdog)),
        ("opsd's detection only", Policy(interval_s=PRACTICE_INTERVAL_S, detection=opsd_detection)),
        ("opsd's policies", Policy(detection=opsd_detection)),
    ]


def sensitivities(scenario: Scenario, policy: Policy) -> list[tuple[str, float]]:
    """ETTR lost per unit of each cost, on the same failures (a forward difference over a step of one unit)."""
    base = simulate(scenario, policy).ettr
    c = scenario.costs
    changed = [
        ("minute of relaunch", dataclasses.replace(scenario, costs=dataclasses.replace(c, restart_s=c.restart_s + 60))),
        (
            "second of blocking save",
            dataclasses.replace(
                scenario, costs=dataclasses.replace(c, checkpoint_blocking_s=c.checkpoint_blocking_s + 1)
            ),
        ),
    ]
    out = [(name, base - simulate(s, policy).ettr) for name, s in changed]
    slower = dataclasses.replace(policy, detection=policy.delays.plus(60.0))
    out.append(("minute of detection", base - simulate(scenario, slower).ettr))
    return out


def describe(result: Result) -> str:
    buckets = ", ".join(f"{k} {v / result.wall_s:.2%}" for k, v in result.badput_s.items() if v)
    return f"ETTR {result.ettr:.4f}, checkpoint every {result.mean_interval_s:.0f} s ({buckets})"


def print_replica_groups(scenario: Scenario, policy: Policy, restart: Result) -> None:
    """(d): replica groups beside the checkpoint restart ``restart`` (opsd's policies), on the same failures."""
    stall_s, heal_here_s, source = ft_measured()
    c = dataclasses.replace(
        scenario.costs,
        quorum_stall_s=stall_s,
        signal_s=SIGNAL_S,
        communicator_rebuild_s=COMMUNICATOR_REBUILD_S,
        heal_transfer_s=HEAL_TRANSFER_S,
    )
    print(
        f"(d) fault-tolerant replica groups on NCCL, the other groups training on: a {stall_s:.2f} s quorum stall "
        f"(measured: {source}); opsd's word {SIGNAL_S:g} s after a detection, else a {c.collective_timeout_s:g} s "
        f"collective timeout; a new communicator {COMMUNICATOR_REBUILD_S:g} s (assumed) at each quorum change; "
        f"a group's relaunch and heal {c.restart_s:.0f} s (the relaunch above), its state's transfer "
        f"{HEAL_TRANSFER_S:.1f} s; network failures restart the whole job:"
    )
    print(f"  {'checkpoint restart':>24}: {describe(restart)}")
    rows = [(g, c.restart_s, True) for g in FT_GROUPS] + [(8, c.restart_s, False), (8, heal_here_s, True)]
    for groups, heal_s, told in rows:
        costs = dataclasses.replace(c, heal_s=heal_s)
        ft_policy = dataclasses.replace(policy, replica_groups=groups, survivors_told=told)
        ft = simulate(dataclasses.replace(scenario, costs=costs), ft_policy)
        name = f"{groups} groups" + (f", heal {heal_s:.0f} s" if heal_s != c.restart_s else "")
        name += "" if told else ", untold"
        print(f"  {name:>24}: {describe(ft)}; {ft.replica_recoveries} of {ft.failures} failures by one group")


def print_costs(scaled: Scaled, measured: measured_costs.Measured, job: Job) -> None:
    print(f"costs measured here ({measured.source}), scaled to {job.gpus:,} GPUs (bench.scale_model):")
    for p in scaled.parts:
        here = "-" if p.here_s is None else f"{p.here_s:.2f} s"
        print(f"  {p.cost + ', ' + p.part:<34} {here:>9} -> {p.at_scale_s:7.2f} s  {p.rule}")
    c, d = scaled.costs, scaled.detection
    print(
        f"  = a {c.checkpoint_blocking_s:.2f} s blocking save, durable {c.checkpoint_background_s:.1f} s later; "
        f"a {c.restart_s:.0f} s relaunch; detection: XID {d.xid_s:.1f} s, node lost {d.node_lost_s:g} s, "
        f"hang {d.hang_s:g} s, exit {d.exit_s:g} s, silent data corruption {d.silent_s:g} s (assumed, any policy)"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--replicas", type=int, default=20, help="54-day runs per policy, summed")
    parser.add_argument("--points", type=int, default=25, help="fixed intervals in the sweep")
    parser.add_argument("--costs", type=Path, default=measured_costs.DEFAULT_PATH, help="the measured costs (JSON)")
    parser.add_argument("--measure", action="store_true", help="measure the costs first and rewrite --costs")
    args = parser.parse_args(argv)
    if args.measure:
        measured_costs.save(measured_costs.measure(), args.costs)
    measured = measured_costs.load(args.costs)
    workload: Workload = presets()["llama3-405b"]
    job = Job(gpus=workload.gpus)
    scaled = scale(measured, job)

    def scenario(costs: Costs) -> Scenario:
        return Scenario(workload, workload.days, costs, replicas=args.replicas)

    measured_scenario = scenario(scaled.costs)
    opsd = simulate(measured_scenario, Policy(detection=scaled.detection))
    print(
        f"{workload.name}: {workload.gpus:,} GPUs, {workload.days:g} days x {args.replicas}: "
        f"{opsd.failures} unexpected interruptions, {opsd.planned} planned"
    )
    print_costs(scaled, measured, job)

    print("(a) the policies alone, at equal costs (the same failures, the same spare pool):")
    blocks = [
        ("the practice's costs: a 10 s synchronous save, a 300 s restart", PRACTICE_COSTS, DETECTION["opsd"]),
        ("the measured costs", scaled.costs, scaled.detection),
    ]
    for title, costs, detection in blocks:
        print(f"  at {title}:")
        for name, policy in policies(detection):
            r = simulate(scenario(costs), policy)
            lost = lost_gpu_hours(r, workload.gpus) / args.replicas
            print(f"    {name:<38} ETTR {r.ettr:.4f}, {lost:9,.0f} GPU-h lost a run")

    print("(b) ETTR lost per extra unit of each cost, at the measured costs:")
    for name, loss in sensitivities(measured_scenario, Policy(detection=scaled.detection)):
        print(f"    {name:<25} {loss:.4%}")

    print("(c) opsd at the measured costs, against the best fixed interval and the practice at its own costs:")
    fixed = sweep(measured_scenario, Policy(detection=scaled.detection), log_grid(60.0, 3600.0, args.points))
    best = max(fixed, key=lambda r: r.ettr)
    practice = simulate(scenario(PRACTICE_COSTS), policies(DETECTION["opsd"])[0][1])
    for name, r in (("opsd", opsd), ("best fixed", best), ("practice", practice)):
        print(f"  {name:>10}: {describe(r)}")
    print_replica_groups(measured_scenario, Policy(detection=scaled.detection), opsd)
    print(f"adaptive_vs_best_fixed={lost_gpu_hours(opsd, workload.gpus) / lost_gpu_hours(best, workload.gpus):.4f}")
    print(f"ettr_llama3_16k={opsd.ettr:.4f}")


if __name__ == "__main__":
    main()
