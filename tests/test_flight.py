"""Flight Recorder dumps: written by the ranks' hooks, uploaded by the agent, kept and analysed by the controller.

The dumps analysed are real: a module-scoped fixture runs ``python -m tests.test_flight`` (``job`` below) as a
3-rank gloo job once. Ranks 0-2 form the ``dp_shard`` group (the world) and ranks 0-1 a ``tp`` group. After three
steps, rank 0 puts a ``dump_flight_recorder`` command ``cmd-1`` in the policy file: every rank dumps, all in step.
Then rank 2 stops outside any collective while ranks 0 and 1 wait for it in a ``dp_shard`` all-reduce: after 1 s
each reports a collective timeout and dumps on its own (``timeout-<rank>-3``); rank 2 then asks for ``cmd-2``, which
all three dump (ranks 0 and 1 inside the all-reduce, rank 2 in ``wait_for``), and joins the all-reduce.
"""

from __future__ import annotations

import copy
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest

from opsd.analysis.flight_recorder import analyze
from opsd.api.app import create_app
from opsd.backends.local.processes import free_port
from opsd.controller.config import ControllerConfig
from opsd.controller.controller import Controller
from opsd.controller.flight import collect_dumps
from opsd.controller.rows import RunSpec
from opsd.controller.state import StateStore
from opsd.protocol.flight_dump import as_dump
from opsd.protocol.heartbeat import Heartbeat
from opsd.protocol.policy_file import EMPTY, Command
from opsd.protocol.steps import Dumped
from opsd_agent.flight import FlightUploader, FlightUploaderConfig, controller_base
from opsd_agent.metrics import FlightCollector
from tests.launch import run_module
from tests.serving import start_api
from tests.waiting import wait_for
from trainer_hooks.process_exit import run_and_exit

RUN = "fr"
TOKEN = "s3cret"
Dumps = dict[str, dict[int, dict[str, Any]]]  # trigger -> rank -> dump
Stuck = list[tuple[str, list[int], list[int]]]  # stuck groups: (label, joined, missing)


# -- the job (run by torchrun) -----------------------------------------------------------------------------------
def write_command(policy: Path, command_id: str) -> None:
    tmp = policy.with_name(f".{policy.name}.tmp")
    tmp.write_text(json.dumps({"v": 1, "commands": [{"id": command_id, "name": "dump_flight_recorder"}]}))
    os.replace(tmp, policy)


def analyzed(dumps: dict[int, dict[str, Any]], *args: Any) -> Any:
    """The analysis of dumps (JSON values, decoded as the controller decodes those it kept), as JSON values, as the
    API answers it."""
    return json.loads(msgspec.json.encode(analyze({r: as_dump(d) for r, d in dumps.items()}, *args)))


def job() -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from trainer_hooks.monitor import Monitor, MonitorConfig

    flight, policy = Path(os.environ["OPSD_FLIGHT_DIR"]) / RUN, Path(os.environ["OPSD_POLICY_FILE"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (3,), mesh_dim_names=("dp_shard",))
    monitor = Monitor.from_mesh(mesh, None, MonitorConfig(run_id=RUN, collective_timeout_s=1.0))
    tp = dist.new_group([0, 1])
    if rank < 2:
        monitor.label(tp, "tp")
    world = mesh.get_group("dp_shard")
    t = torch.ones(4)
    for _ in range(3):
        with monitor.step(tokens=1):
            dist.all_reduce(t, group=world)
            if rank < 2:
                dist.all_reduce(t, group=tp)
    # commands from now on are this process's
    wait_for("first look at the policy file", lambda: monitor.flight.policy_seen, 30)
    dist.barrier()
    if rank == 0:
        write_command(policy, "cmd-1")
    wait_for("dump of cmd-1", (flight / "cmd-1" / f"rank-{rank}.json").exists, 30)
    dist.barrier()
    if rank == 2:  # stopped outside any collective: its peers wait for it, time out, dump
        wait_for("timeout dumps of both peers", lambda: len(list(flight.glob("timeout-*/rank-*.json"))) == 2, 30)
        write_command(policy, "cmd-2")
        wait_for("dumps of cmd-2 by every rank", lambda: len(list(flight.glob("cmd-2/rank-*.json"))) == 3, 30)
    with monitor.step(tokens=1):
        if rank < 2:
            dist.all_reduce(t, group=tp)
        dist.all_reduce(t, group=world)
    monitor.close()
    dist.destroy_process_group()


# -- fixtures ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Dumps:
    tmp = tmp_path_factory.mktemp("flight")
    env = {"OPSD_FLIGHT_DIR": str(tmp / "flight"), "OPSD_POLICY_FILE": str(tmp / "policy.json")}
    proc = run_module("tests.test_flight", [], nproc=3, env=env, timeout_s=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out: Dumps = {}
    for path in sorted((tmp / "flight" / RUN).glob("*/rank-*.json")):
        out.setdefault(path.parent.name, {})[int(path.stem.split("-")[1])] = json.loads(path.read_text())
    return out


@pytest.fixture
def controller(tmp_path: Path) -> Controller:
    store = StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}")
    store.create_run(RUN, RunSpec(backend="test"), time.time())
    return Controller(store, ControllerConfig())


@pytest.fixture
def api(controller: Controller) -> Iterator[str]:
    """The controller's real app on uvicorn, on loopback; its base URL."""
    port = free_port()
    server = start_api(controller, TOKEN, "127.0.0.1", port)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True


def seq_of(dump: dict[str, Any], label: str) -> int:
    """The last sequence id a dump shows for the group labelled ``label``."""
    (name,) = [n for n, g in dump["groups"].items() if g["dim"] == label and len(g["ranks"]) > 1]
    return max(e["collective_seq_id"] for e in dump["trace"]["entries"] if e["process_group"][0] == name)


# -- the hooks ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_ranks_dump_on_a_command_and_after_a_collective_timeout(recorded: Dumps) -> None:
    assert sorted(recorded) == ["cmd-1", "cmd-2", "timeout-0-3", "timeout-1-3"]
    assert sorted(recorded["cmd-1"]) == sorted(recorded["cmd-2"]) == [0, 1, 2]
    assert sorted(recorded["timeout-0-3"]) == [0]
    assert sorted(recorded["timeout-1-3"]) == [1]
    dump = recorded["cmd-1"][0]
    assert (dump["run"], dump["trigger"], dump["rank"], dump["world_size"]) == (RUN, "cmd-1", 0, 3)
    groups = {g["dim"]: g["ranks"] for g in dump["groups"].values() if len(g["ranks"]) > 1}
    assert groups == {"dp_shard": [0, 1, 2], "tp": [0, 1]}  # gloo's own pg_config names no members
    entries = dump["trace"]["entries"]
    assert {e["profiling_name"] for e in entries} >= {"gloo:all_reduce"}
    assert "frames" in entries[-1]
    assert "frames" not in entries[0]
    assert any(f["name"] == "job" for f in entries[-1]["frames"])
    # the training thread's stack, as the watchdog saw it: in the all-reduce rank 2 never joined, or waiting
    assert "all_reduce" in recorded["timeout-0-3"][0]["stack"]
    assert "in wait_for" in recorded["cmd-2"][2]["stack"]


# -- the analysis, on real dumps ---------------------------------------------------------------------------------
def lag_on_tp(recorded: Dumps) -> dict[int, dict[str, Any]]:
    """The in-step dumps, with rank 0 one tp all-reduce ahead of rank 1, waiting in it."""
    dumps = copy.deepcopy(recorded["cmd-1"])
    name = next(n for n, g in dumps[0]["groups"].items() if g["dim"] == "tp")
    entries = dumps[0]["trace"]["entries"]
    last = max((e for e in entries if e["process_group"][0] == name), key=lambda e: e["collective_seq_id"])
    entries.append({**last, "record_id": last["record_id"] + 100, "collective_seq_id": last["collective_seq_id"] + 1})
    status = dumps[0]["trace"]["pg_status"][str(last["pg_id"])]
    status["last_enqueued_collective"] = last["collective_seq_id"] + 1
    return dumps


def cycle(recorded: Dumps) -> dict[int, dict[str, Any]]:
    """Ranks 0 and 2 in a dp_shard all-reduce that rank 1 never joins: it waits in a tp all-reduce rank 0 never
    joins."""
    dumps = copy.deepcopy(recorded["cmd-1"])
    for rank, label in ((0, "dp_shard"), (2, "dp_shard"), (1, "tp")):
        name = next(n for n, g in dumps[rank]["groups"].items() if g["dim"] == label and len(g["ranks"]) > 1)
        entries = dumps[rank]["trace"]["entries"]
        last = max((e for e in entries if e["process_group"][0] == name), key=lambda e: e["collective_seq_id"])
        seq = last["collective_seq_id"] + 1
        entries.append({**last, "record_id": last["record_id"] + 100, "collective_seq_id": seq})
        dumps[rank]["trace"]["pg_status"][str(last["pg_id"])]["last_enqueued_collective"] = seq
    return dumps


def stuck(analysis: dict[str, Any]) -> Stuck:
    return [(g["group"], g["joined"], g["missing"]) for g in analysis["groups"]]


CASES: dict[str, tuple[Callable[[Dumps], dict[int, dict[str, Any]]], list[int], Stuck, list[int], str]] = {
    # name: (dumps, ranks expected, stuck groups (label, joined, missing), culprits, the first culprit's reason)
    "all in step": (lambda r: r["cmd-1"], [0, 1, 2], [], [], ""),
    "a rank sent no dump": (
        lambda r: {k: v for k, v in r["cmd-2"].items() if k != 2},
        [0, 1, 2],
        [("dp_shard", [0, 1], [2])],
        [2],
        "sent no dump: never joined all_reduce #{world} of group dp_shard",
    ),
    "a rank lags one collective, outside any": (
        lambda r: r["cmd-2"],
        [0, 1, 2],
        [("dp_shard", [0, 1], [2])],
        [2],
        "never joined all_reduce #{world} of group dp_shard (pg 0): it waits on no collective",
    ),
    "a rank lags by one on one group only": (lag_on_tp, [0, 1, 2], [("tp", [0], [1])], [1], "never joined all_reduce"),
    "a cycle: each waits for the other": (
        cycle,
        [0, 1, 2],
        [("dp_shard", [0, 2], [1]), ("tp", [1], [0])],
        [0, 1],
        "never joined all_reduce",
    ),
    "no rank dumped": (lambda r: {}, [0, 1, 2], [], [0, 1, 2], "sent no dump"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_analysis_names_the_culprit(recorded: Dumps, case: str) -> None:
    make, expected, groups, culprits, reason = CASES[case]
    analysis = analyzed(make(recorded), expected, "incident-7", 7)
    assert (analysis["trigger"], analysis["incident_id"], analysis["ranks_expected"]) == ("incident-7", 7, expected)
    assert stuck(analysis) == groups, analysis
    assert [c["rank"] for c in analysis["culprits"]] == culprits, analysis["culprits"]
    world = seq_of(recorded["cmd-2"][0], "dp_shard")
    if reason:
        assert analysis["culprits"][0]["reason"].startswith(reason.format(world=world)), analysis["culprits"][0]
    json.dumps(analysis)  # the contract is JSON


@pytest.mark.slow
def test_analysis_places_a_silent_rank_from_its_peers_view(recorded: Dumps) -> None:
    analysis = analyzed({k: v for k, v in recorded["cmd-2"].items() if k != 2}, [0, 1, 2], "incident-7", 7)
    world = seq_of(recorded["cmd-2"][0], "dp_shard")
    (group,) = analysis["groups"]
    assert (group["stuck_seq"], group["op"], group["ranks"]) == (world, "all_reduce", [0, 1, 2])
    assert group["last_seq_by_rank"] == {"0": world, "1": world, "2": world - 1}
    (culprit,) = analysis["culprits"]
    last = culprit["last_collective"]
    assert (last["group"], last["seq"], last["op"], last["state"]) == ("dp_shard", world - 1, "barrier", "completed")
    assert culprit["stack"] is None
    assert (
        analysis["summary"]
        == f"rank 2 never joined all_reduce #{world} on dp_shard: ranks 0, 1 wait for it (it sent no dump)"
    )
    lagging = analyzed(recorded["cmd-2"], [0, 1, 2], "cmd-2", None)["culprits"][0]
    assert lagging["last_collective"]["seq"] == world - 1
    assert "wait_for" in lagging["stack"]


# -- agent -> controller -----------------------------------------------------------------------------------------
def place(directory: Path, dump: dict[str, Any], trigger: str | None = None) -> Path:
    """Put a dump where a rank of the node would have written it (``trigger`` renames it)."""
    dump = {**dump, "trigger": trigger or dump["trigger"]}
    path = directory / dump["run"] / dump["trigger"] / f"rank-{dump['rank']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dump))
    return path


@pytest.mark.slow
def test_a_hangs_dumps_reach_the_controller_and_name_the_stopped_rank(
    recorded: Dumps, controller: Controller, api: str, tmp_path: Path
) -> None:
    """The recovery's ``dump`` action asks for dumps through the policy; ranks 0 and 1 dump (rank 2 is stopped); the
    agent delivers them; the analysis names rank 2."""
    incident, _ = controller.store.open_incident(
        key=f"{RUN}/gen1", run=RUN, kind="hang", node="node-1", rank=2, detail="", failed_s=0.0, detected_s=0.0
    )
    trigger = f"incident-{incident}"
    controller.store.upsert_node("node-0", time.time(), run=RUN, role="active")
    uploader = FlightUploader(FlightUploaderConfig(str(tmp_path / "flight"), api, TOKEN, interval_s=0.1), "node-0")
    uploader.start()
    result: list[Dumped] = []
    collecting = threading.Thread(
        target=lambda: result.append(collect_dumps(controller, RUN, trigger, [0, 1, 2], wait_s=2.0, poll_s=0.05))
    )
    collecting.start()
    try:
        heartbeat = Heartbeat(v=1, node="node-0", time_unix_s=time.time())

        def commands() -> tuple[Command, ...] | None:
            return (controller.heartbeat(heartbeat, time.time()).policy or EMPTY).commands

        wait_for("command in the policy", lambda: commands() is not None, 5)
        assert commands() == (Command(id=trigger, name="dump_flight_recorder"),)
        for rank in (0, 1):  # what the ranks do on that command
            place(tmp_path / "flight", recorded["cmd-2"][rank], trigger)
        collecting.join(timeout=10)
    finally:
        uploader.stop()
    (dumped,) = result
    assert (dumped.ranks_expected, dumped.ranks_dumped) == ([0, 1, 2], [0, 1])
    assert 2.0 <= dumped.waited_s < 4.0  # rank 2 never dumps: the whole wait
    assert (controller.heartbeat(heartbeat, time.time()).policy or EMPTY).commands == ()  # withdrawn: agents rewrite
    assert (uploader.ok, list((tmp_path / "flight").iterdir())) == (2, [])  # delivered: files and directories gone

    with TestClient(create_app(controller, TOKEN), headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        analysis = client.get(f"/v1/runs/{RUN}/flight-recorder").json()[trigger]
        assert (analysis["incident_id"], analysis["ranks_expected"], analysis["ranks_dumped"]) == (
            incident,
            [0, 1, 2],
            [0, 1],
        )
        (culprit,) = analysis["culprits"]
        assert culprit["rank"] == 2
        assert culprit["reason"].startswith("sent no dump: never joined all_reduce")
        raw = client.get(f"/v1/runs/{RUN}/flight-recorder/{trigger}/1").json()
        assert raw["trace"] == recorded["cmd-2"][1]["trace"]
        assert client.get(f"/v1/runs/{RUN}/flight-recorder/{trigger}/2").status_code == 404


def small_dump(rank: int = 0, **changes: Any) -> dict[str, Any]:
    entry = {"record_id": 0, "pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": 1}
    entry |= {"profiling_name": "gloo:all_reduce", "state": "scheduled", "retired": True, "is_p2p": False}
    dump = {"v": 1, "run": RUN, "trigger": "cmd-1", "rank": rank, "world_size": 2, "host": "h", "time_unix_s": 1.0}
    dump |= {"groups": {"0": {"desc": "default_pg", "ranks": [0, 1], "dim": "dp_shard"}}, "stack": None}
    dump["trace"] = {"version": "2.10", "pg_config": {}, "pg_status": {}, "entries": [entry]}
    return {**dump, **changes}


def test_the_uploader_bounds_dump_sizes_and_retries_until_delivered(controller: Controller, tmp_path: Path) -> None:
    directory = tmp_path / "flight"
    port = free_port()
    config = FlightUploaderConfig(str(directory), f"http://127.0.0.1:{port}", TOKEN, max_bytes=4096)
    uploader = FlightUploader(config, "node-0")
    registry = CollectorRegistry()
    registry.register(FlightCollector(lambda: uploader, "node-0"))
    big = place(directory, small_dump(1, stack="x" * 5000))
    small = place(directory, small_dump(0))
    assert not uploader.upload_once()  # nobody listens yet: kept, counted, retried
    assert (uploader.errors, uploader.too_large, uploader.failures, small.exists()) == (1, 1, 1, True)
    assert not big.exists()
    assert big.with_name("rank-1.json.too_large").exists()
    server = start_api(controller, TOKEN, "127.0.0.1", port)
    try:
        assert uploader.upload_once()
    finally:
        server.should_exit = True
    assert (uploader.ok, uploader.failures, small.exists()) == (1, 0, False)
    assert controller.store.flight_ranks(RUN, "cmd-1") == {0}
    text = generate_latest(registry).decode()
    for result, n in (("ok", 1), ("error", 1), ("too_large", 1)):
        assert f'opsd_agent_flight_dumps_total{{node="node-0",result="{result}"}} {n}.0' in text


def test_the_controller_validates_dumps_and_counts_the_bad_ones(controller: Controller) -> None:
    bad = [
        b"not json",
        json.dumps(small_dump(v=2)).encode(),
        json.dumps(small_dump(rank=2)).encode(),  # not below world_size
        json.dumps(small_dump(trigger="../../etc")).encode(),
        json.dumps(small_dump(run="other")).encode(),  # posted to another run
        json.dumps(small_dump(time_unix_s="soon")).encode(),
        json.dumps({k: v for k, v in small_dump().items() if k != "trace"}).encode(),
    ]
    auth = {"Authorization": f"Bearer {TOKEN}"}
    url = f"/v1/runs/{RUN}/flight-recorder"
    with TestClient(create_app(controller, TOKEN), headers=auth) as client:
        assert client.post(url, content=json.dumps(small_dump()), headers={"Authorization": ""}).status_code == 401
        for body in bad:
            reply = client.post(url, content=body, headers=auth)
            assert reply.status_code == 422, (body[:80], reply.text)
        assert "world_size" in client.post(url, content=bad[2], headers=auth).json()["detail"]
        metrics = client.get("/metrics").text
        assert f'opsd_controller_rejected_requests_total{{reason="validation"}} {len(bad) + 1}.0' in metrics
        elsewhere = json.dumps(small_dump(run="nope"))
        assert client.post("/v1/runs/nope/flight-recorder", content=elsewhere, headers=auth).status_code == 404
        first = json.dumps(small_dump())
        assert client.post(url, content=first, headers=auth).json()["stored"] is True
        assert client.post(url, content=json.dumps(small_dump(host="again")), headers=auth).json()["stored"] is False
        assert client.get(f"{url}/cmd-1/0").text == first  # the first one is kept, as sent
        analysis = client.get(url).json()["cmd-1"]
        assert (analysis["ranks_expected"], analysis["ranks_dumped"], analysis["incident_id"]) == ([0, 1], [0], None)
        assert [c["rank"] for c in analysis["culprits"]] == [1]
        assert client.get("/v1/runs/nope/flight-recorder").status_code == 404


# -- the hooks' recorder, in one process -------------------------------------------------------------------------
def test_a_rank_runs_only_the_commands_that_appear_after_it_started(tmp_path: Path) -> None:
    from trainer_hooks.flight import FlightRecorder

    policy = tmp_path / "policy.json"
    write_command(policy, "old")  # left by the incident that stopped this rank's predecessor
    recorder = FlightRecorder(RUN, 0, 1, directory=str(tmp_path / "flight"), policy_path=str(policy))
    recorder.policy.check_every_s = 0  # type: ignore[union-attr]
    assert recorder.poll() == []
    assert recorder.policy_seen
    time.sleep(0.01)  # what a rewrite of the file is: a new modification time, which the recorder looks for
    write_command(policy, "newer")
    (path,) = recorder.poll()
    assert path == tmp_path / "flight" / RUN / "newer" / "rank-0.json"
    dump = json.loads(path.read_text())
    # the process's trace: empty, or the collectives of tests that ran before in this process
    assert (dump["trigger"], isinstance(dump["trace"]["entries"], list)) == ("newer", True)
    assert "test_a_rank_runs_only" in dump["stack"]
    assert recorder.poll() == []  # once per command
    assert FlightRecorder(RUN, 0, 1, directory=None).dump("x") is None  # no directory (and no $OPSD_FLIGHT_DIR)
    (tmp_path / "file").write_text("")
    broken = FlightRecorder("a/../b", 0, 1, directory=str(tmp_path / "file"))
    assert broken.dump("x") is None
    assert broken.errors == 1


def test_controller_base_from_the_heartbeat_url() -> None:
    assert controller_base("http://opsd:8470/v1/heartbeat") == "http://opsd:8470"
    assert controller_base("https://h/prefix/v1/heartbeat/") == "https://h/prefix"
    assert controller_base("http://h:1/other") == "http://h:1"


def main() -> None:
    job()


if __name__ == "__main__":
    run_and_exit(main)  # the exit code main means, whatever gloo's threads are doing (docs/crash.md)
