"""The controller at Llama 3 scale and beyond: ``python -m bench.controller_scale``.

Starts ``opsd serve`` as its own process (the real API on uvicorn, its liveness and heartbeat processes, its
detection pass every 0.5 s), then simulated agents in ``--clients`` processes (``bench.simulated_agents``): one per
node, 3,072 nodes x 8 GPUs (24,576 ranks) by default, the nodes' phases spread evenly over the second. Each node, as
``opsd agent`` does, says it is alive by a signed datagram every second, and sends a heartbeat with its ranks
(``opsd.protocol.heartbeat``) over a keep-alive connection at the interval the controller's replies ask for, in its
own slot of it (``opsd.policy.telemetry``), to the controller's heartbeat process once a reply names its port;
``--mode http``: a heartbeat with the ranks every second to the API, as agents did before.

The agents come up over ``--ramp-s`` (10 s); after ``--warmup-s`` (first contact: every node and run recorded, the
interval settled), for ``--duration-s``:

- ingest latency, on the client side: a heartbeat's request written to the last bytes of its response read, and a
  datagram sent to its acknowledgement read, both timed as the load process reads them (p50, p99, max);
- the load processes' own delay, which both latencies include: how late their event loops wake (the pacer's sleeps);
  they share the controller's cores, where agents would run on nodes of their own;
- heartbeats and datagrams a second, and the errors;
- CPU: the controller's share of one core and its worker processes', the load generators' and the machine's; the
  controller's memory;
- silent-node detection: 10 s before the end of the window (at its start if it is shorter) one node dies: it stops
  sending, and the other nodes' ranks step no more (a synchronous job waits for the dead node's ranks: the second
  witness the controller needs, ``opsd.policy.detection``); the time from its last sign of life to the moment
  ``GET /v1/runs/{run}/incidents`` shows its ``heartbeat_loss`` (polled every 0.25 s). The controller waits for a
  step of the peers' that would prove the node alive for its beat, one step, the ranks' report interval and a margin,
  and one report interval more, so at the 9 s interval of 12,288 nodes the verdict comes ~20 s after the last beat.
  The controller runs with ``--heartbeat-floor-s 3``: with a sign of life every second its limit is then 5 x the
  median interval observed, 5 s (the default floor, 10 s, would set the limit by itself).

The warm-up must be long enough for the start to settle, by default a second per 200 nodes (61 s at 12,288): 12,288
first connections within 10 s overflow this machine's listen queue (``net.core.somaxconn`` 4,096), and the agents'
retries come over tens of seconds. ``docs/controller.md``, "Scale", has the figures. Smaller runs: ``--nodes 64
--duration-s 10``.

Last lines: ``heartbeat_p99_ms=``, ``datagram_p99_ms=``, ..., ``ingest_p99_ms=`` and ``silent_node_detect_s=``.
"""

from __future__ import annotations

import argparse
import array
import http.client
import json
import logging
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.simulated_agents import POLL_S, RUN, SILENT_BEFORE_END_S, TOKEN, Plan, generate, node_name
from opsd.backends.local.processes import free_port
from opsd.protocol.states import IncidentKind

log = logging.getLogger(__name__)


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (the controller's liveness and heartbeat processes)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return found


def machine_busy_s() -> tuple[float, float, float]:
    """(busy, stolen, total) CPU seconds of the machine so far, all cores (stolen: by the hypervisor)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    idle, steal, tick = values[3] + values[4], values[7], os.sysconf("SC_CLK_TCK")
    return (sum(values) - idle - steal) / tick, steal / tick, sum(values) / tick


def get_json(conn: http.client.HTTPConnection, path: str) -> Any:
    conn.request("GET", path, headers={"authorization": f"Bearer {TOKEN}"})
    response = conn.getresponse()
    data = response.read()
    return json.loads(data) if response.status == 200 else None


def start_controller(state: Path, port: int, heartbeat_floor_s: float, log_path: Path) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "opsd",
        "serve",
        "--port",
        str(port),
        "--state-dir",
        str(state),
        "--token",
        TOKEN,
        "--heartbeat-floor-s",
        str(heartbeat_floor_s),
        "--log-level",
        "WARNING",
    ]
    with log_path.open("wb") as out:
        controller = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            if get_json(conn, "/healthz"):
                conn.close()
                return controller
        except OSError:
            pass
        if time.monotonic() > deadline or controller.poll() is not None:
            controller.kill()
            raise RuntimeError(f"the controller did not start: {log_path.read_text()[-2000:]}")
        time.sleep(0.2)


def watch_for_loss(port: int, since_s: float, until_s: float) -> tuple[float, dict[str, Any] | None]:
    """Poll the run's incidents from ``since_s`` until one is a failure; (when it was seen, the incident)."""
    time.sleep(max(0.0, since_s - time.time()))
    while time.time() < until_s:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=max(1.0, until_s - time.time()))
        try:
            for incident in get_json(conn, f"/v1/runs/{RUN}/incidents") or []:
                if incident["kind"] != IncidentKind.STRAGGLER:
                    return time.time(), incident
        except OSError as exc:  # a controller too busy to answer in time
            log.warning("polling the incidents: %s", exc)
        finally:
            conn.close()
        time.sleep(POLL_S)
    return float("inf"), None


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def final_status(port: int) -> dict[str, Any]:
    try:
        return get_json(http.client.HTTPConnection("127.0.0.1", port, timeout=30), f"/v1/runs/{RUN}") or {}
    except OSError as exc:
        log.warning("reading the run's status: %s", exc)
        return {}


def controller_metrics(port: int) -> dict[str, float]:
    """The controller's own series (``opsd_controller_*``) at the end, by name and labels."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/metrics", headers={"authorization": f"Bearer {TOKEN}"})
        text = conn.getresponse().read().decode()
    except OSError as exc:
        log.warning("reading the controller's metrics: %s", exc)
        return {}
    finally:
        conn.close()
    found = (line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("opsd_controller_"))
    return {name: float(value) for name, value in found}


def percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.controller_scale", description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=3072)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--duration-s", type=float, default=30.0, help="the measured window")
    p.add_argument(
        "--warmup-s",
        type=float,
        default=None,
        help="heartbeats before the window (first contact; default: a second per 200 nodes, at least 15 s)",
    )
    p.add_argument("--clients", type=int, default=2, help="load generator processes")
    p.add_argument(
        "--ramp-s",
        type=float,
        default=None,
        help="the agents come up over this long (default: 10 s, at most half the warm-up)",
    )
    p.add_argument("--heartbeat-floor-s", type=float, default=3.0, help="the controller's --heartbeat-floor-s")
    p.add_argument(
        "--mode",
        choices=("datagrams", "http"),
        default="datagrams",
        help="agents that say they are alive by datagram and send their ranks at the controller's interval, or agents "
        "that send a heartbeat with their ranks every second (as before liveness datagrams)",
    )
    args = p.parse_args(argv)
    if args.warmup_s is None:  # long enough for a start to settle (61 s at 12,288 nodes)
        args.warmup_s = max(15.0, args.nodes / 200)
    if args.duration_s <= 0 or args.warmup_s < 0 or args.clients < 1:
        p.error("--duration-s must be > 0, --warmup-s >= 0, --clients >= 1")

    with tempfile.TemporaryDirectory(prefix="controller-scale-") as tmp:
        port = free_port()
        log_path = Path(tmp) / "controller.log"
        controller = start_controller(Path(tmp) / "state", port, args.heartbeat_floor_s, log_path)
        context = multiprocessing.get_context("spawn")
        stop = context.Event()
        results = context.Queue()
        start_s = time.time() + 3.0  # the generators start and connect first
        begin = start_s + args.warmup_s
        plan = Plan(
            host="127.0.0.1",
            port=port,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            start_s=start_s,
            window_s=(begin, begin + args.duration_s),
            silent_node=args.nodes // 2,
            silent_s=begin + max(0.0, args.duration_s - SILENT_BEFORE_END_S),
            datagrams=args.mode == "datagrams",
            ramp_s=min(10.0, args.warmup_s / 2) if args.ramp_s is None else args.ramp_s,
        )
        generators = [
            context.Process(target=generate, args=(plan, part, args.clients, stop, results), daemon=True)
            for part in range(args.clients)
        ]
        try:
            for g in generators:
                g.start()
            time.sleep(max(0.0, begin - time.time()))
            pids = [controller.pid, *children(controller.pid)] + [g.pid or 0 for g in generators]
            cpu_before, machine_before, read_s = [cpu_s(pid) for pid in pids], machine_busy_s(), time.time()
            seen_s, incident = watch_for_loss(port, plan.silent_s, plan.window_s[1] + 60)
            time.sleep(max(0.0, plan.window_s[1] - time.time()))
            cpu_after, machine_after = [cpu_s(pid) for pid in pids], machine_busy_s()
            wall = time.time() - read_s
            status, memory = final_status(port), rss_bytes(controller.pid)
            series = controller_metrics(port)
            stop.set()
            tallies = [results.get(timeout=60) for _ in generators]
            for g in generators:
                g.join(timeout=30)
        except Exception:
            log.error("the controller's log ends with:\n%s", log_path.read_text()[-3000:])
            raise
        finally:
            stop.set()
            controller.terminate()
            try:
                controller.wait(timeout=30)
            except subprocess.TimeoutExpired:
                controller.kill()
            for g in generators:
                if g.is_alive():
                    g.kill()

    latencies: array.array[float] = array.array("d")
    datagram_ms: array.array[float] = array.array("d")
    lag_ms: array.array[float] = array.array("d")
    ok = errors = late = datagrams = lost = 0
    silent_last_s = 0.0
    for _, data, acked, lagged, n_ok, n_errors, n_late, last_s, n_datagrams, n_lost in tallies:
        latencies.frombytes(data)
        datagram_ms.frombytes(acked)
        lag_ms.frombytes(lagged)
        ok, errors, late = ok + n_ok, errors + n_errors, late + n_late
        datagrams, lost = datagrams + n_datagrams, lost + n_lost
        silent_last_s = max(silent_last_s, last_s)
    ordered, ordered_datagrams, ordered_lag = sorted(latencies), sorted(datagram_ms), sorted(lag_ms)
    window = plan.window_s[1] - plan.window_s[0]
    shares = [(a - b) / wall for a, b in zip(cpu_after, cpu_before, strict=True)]
    worker = sum(shares[1 : len(shares) - len(generators)])
    busy, stolen = ((machine_after[i] - machine_before[i]) / (machine_after[2] - machine_before[2]) for i in (0, 1))
    silent = node_name(plan.silent_node)
    found = incident is not None and (incident["kind"], incident["node"]) == ("heartbeat_loss", silent)
    detect_s = seen_s - silent_last_s if found else float("inf")
    ranks = args.nodes * args.gpus_per_node
    http_p99, datagram_p99 = percentile(ordered, 0.99), percentile(ordered_datagrams, 0.99)
    print(
        f"load: {args.nodes} nodes x {args.gpus_per_node} GPUs ({ranks} ranks), a beat a second per node "
        f"({args.mode}), {args.clients} load processes, window {window:.0f} s after {args.warmup_s:.0f} s of warm-up"
    )
    print(
        f"heartbeats with ranks: {ok} answered ({ok / window:.0f}/s; at the interval the controller asks for: "
        f"{series.get('opsd_controller_telemetry_interval_seconds', float('nan')):g} s), {errors} errors, {late} beats "
        f"over 0.5 s late; answered by the heartbeat process "
        f"{series.get('opsd_controller_heartbeats_apart_total', 0):.0f} in all, sent by it to the API "
        f"{series.get('opsd_controller_heartbeats_sent_to_api_total', 0):.0f}"
    )
    print(
        f"  latency: p50 {percentile(ordered, 0.5):.1f} ms, p99 {http_p99:.1f} ms, "
        f"max {ordered[-1] if ordered else float('nan'):.1f} ms"
    )
    print(
        f"liveness datagrams: {datagrams} sent ({datagrams / window:.0f}/s; one node silent for the last "
        f"{plan.window_s[1] - plan.silent_s:.0f} s), {lost} not acknowledged; the controller took "
        f"{series.get('opsd_controller_liveness_datagrams_total', 0):.0f} in all, refused "
        f"{sum(v for k, v in series.items() if k.startswith('opsd_controller_liveness_refused_total')):.0f}"
    )
    print(
        f"  latency to the acknowledgement: p50 {percentile(ordered_datagrams, 0.5):.1f} ms, p99 "
        f"{datagram_p99:.1f} ms, max {ordered_datagrams[-1] if ordered_datagrams else float('nan'):.1f} ms"
    )
    print(
        f"the load processes' own delay (in both latencies): their pacer woke late by p50 "
        f"{percentile(ordered_lag, 0.5):.1f} ms, p99 {percentile(ordered_lag, 0.99):.1f} ms"
    )
    print(
        f"CPU: controller {shares[0] * 100:.0f}% of a core and its worker processes {worker * 100:.0f}%, load "
        f"generators {sum(shares[-len(generators) :]) * 100:.0f}%, machine busy {busy * 100:.0f}% of "
        f"{os.cpu_count()} cores (stolen by the hypervisor {stolen * 100:.0f}%), load average "
        f"{os.getloadavg()[0]:.1f}; controller memory "
        f"{memory / 2**20:.0f} MiB"
    )
    print(
        f"status: {status.get('ranks')} ranks, step {status.get('step')}, "
        f"stragglers {[s['rank'] for s in status.get('stragglers', [])]}"
    )
    if incident is not None and found:
        print(
            f"silent node {silent}: {incident['detail']}; the controller took "
            f"{incident['detected_s'] - incident['failed_s']:.1f} s after its last sign of life, seen "
            f"{detect_s:.1f} s after"
        )
    else:
        print(f"silent node {silent}: not detected; the incident: {incident}")
    print(f"heartbeat_p99_ms={http_p99:.1f}")
    print(f"datagram_p99_ms={datagram_p99:.1f}")
    print(f"controller_cpu_ratio={shares[0] + worker:.2f}")
    print(f"heartbeats_per_s={ok / window:.0f}")
    print(f"datagrams_per_s={datagrams / window:.0f}")
    print(f"load_lag_p99_ms={percentile(ordered_lag, 0.99):.1f}")
    print(f"ingest_p99_ms={max(http_p99, datagram_p99 if ordered_datagrams else 0.0):.1f}")
    print(f"silent_node_detect_s={detect_s:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
