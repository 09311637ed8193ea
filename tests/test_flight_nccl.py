"""NCCL's Flight Recorder, from a real dump: torch 2.11.0+cu130 on one H100 (NCCL 2.28.9) ran 7 collectives on two
NCCL groups and dumped them with ``_dump_nccl_trace(includeCollectives=True, includeStackTraces=True,
onlyActive=False)`` (``tests/data/flight_recorder_nccl_h100.json``: torch's pickle as JSON values; the same world's
``_dump_fr_trace`` had no entry). No GPU here: the rank's dump is made from that file by a stand-in for torch's dump
function that returns those values pickled, and a hang of two ranks is made from it by editing one rank's copy."""

from __future__ import annotations

import copy
import datetime
import json
import pickle
from pathlib import Path
from typing import Any

import msgspec
import pytest

from opsd.analysis.flight_recorder import analyze, load_trace, read_dump
from opsd.controller.flight import kept
from opsd.controller.rows import FlightDumpRow
from opsd.errors import BodyError
from opsd.postmortem.model import describe
from opsd.protocol.flight_analysis import FlightAnalysis
from opsd.protocol.flight_dump import as_dump, decode_dump
from trainer_hooks.flight import FlightRecorder

DATA = Path(__file__).parent / "data" / "flight_recorder_nccl_h100.json"


def analyzed(dumps: dict[int, dict[str, Any]], *args: Any) -> Any:
    """The analysis of dumps (JSON values, decoded as the controller decodes those it kept), as JSON values, as the
    API answers it."""
    return json.loads(msgspec.json.encode(analyze({r: as_dump(d) for r, d in dumps.items()}, *args)))


def nccl_trace() -> dict[str, Any]:
    return load_trace(DATA.read_bytes())


def dump(rank: int, world_size: int, nccl: dict[str, Any], gloo: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "v": 1,
        "run": "gpu",
        "trigger": "incident-1",
        "rank": rank,
        "world_size": world_size,
        "time_unix_s": 1795689722.0,
        "groups": {},
        "stack": None,
        "trace": gloo or {"entries": []},
        "nccl_trace": nccl,
    }


def test_a_trace_loads_from_torchs_pickle_or_json_and_nothing_else() -> None:
    trace = nccl_trace()
    assert trace["version"] == "2.10"
    assert len(trace["entries"]) == 7
    assert load_trace(pickle.dumps(trace, protocol=2)) == trace  # what _dump_nccl_trace returns, pickled
    for bad in (pickle.dumps(datetime.date(2026, 1, 1)), b"\x80\x02garbage", b"[1, 2]", b"{not json"):
        with pytest.raises(BodyError, match="Flight Recorder trace"):
            load_trace(bad)


def test_the_nccl_trace_of_a_rank_is_read_per_group_with_durations() -> None:
    seen = read_dump(0, as_dump(dump(0, 1, nccl_trace())), (0,))
    world, sub = seen.groups[("0", (0,))], seen.groups[("1", (0,))]
    assert (world.label, world.enqueued, world.completed) == ("default_pg", 6, 6)
    ops = {seq: e.profiling_name for seq, e in world.entries.items()}
    assert ops[4] == "nccl:_all_gather_base"
    assert (sub.label, sub.enqueued, sub.completed) == ("pg 1", 1, 1)
    assert seen.last is not None
    assert seen.last[1].record_id == 6  # the newest entry of either group
    assert seen.stack is not None
    assert "part_frcapture" in seen.stack  # its frames: where the probe issued it
    report = analyzed({0: dump(0, 1, nccl_trace())}, [0], "probe", None)
    assert report["groups"] == []  # a world of one waits on nobody
    assert report["culprits"] == []


def hung_world() -> dict[int, dict[str, Any]]:
    """Two ranks on the H100's trace: rank 0 issued all-reduce #6 of the default group and waits in it (started,
    not completed), rank 1 never issued it. Both also ran a gloo group (the checkpoints'), in step."""
    trace = nccl_trace()
    trace["pg_config"]["0"]["ranks"] = "[0, 1]"
    first = trace["entries"][0]["time_created_ns"]
    gloo = {
        "pg_config": {},
        "pg_status": {"0": {"last_enqueued_collective": 2, "last_completed_collective": 2}},
        "entries": [
            {
                "record_id": i,
                "pg_id": 0,
                "process_group": ["2", "checkpoint"],
                "collective_seq_id": i + 1,
                "profiling_name": "gloo:all_gather",
                "time_created_ns": first - 1000 + i,
                "state": "scheduled",
            }
            for i in range(2)
        ],
    }
    groups = {"2": {"desc": "checkpoint", "ranks": [0, 1], "dim": "other"}}
    waiting = copy.deepcopy(trace)
    waiting["entries"][-1].update(state="started", retired=False, duration_ms=None)
    waiting["pg_status"]["0"]["last_completed_collective"] = 5
    absent = copy.deepcopy(trace)
    absent["entries"] = [e for e in absent["entries"] if e["record_id"] != 6]
    absent["pg_status"]["0"] = {"last_enqueued_collective": 5, "last_completed_collective": 5}
    return {
        0: {**dump(0, 2, waiting, copy.deepcopy(gloo)), "groups": groups},
        1: {**dump(1, 2, absent, copy.deepcopy(gloo)), "groups": groups},
    }


def test_a_hang_on_nccl_names_the_rank_that_never_joined_and_the_post_mortem_reads_it() -> None:
    report = analyzed(hung_world(), [0, 1], "incident-1", 1)
    (stuck,) = report["groups"]  # the gloo group is in step: only NCCL's default group is stuck
    assert (stuck["group"], stuck["stuck_seq"], stuck["op"]) == ("default_pg", 6, "all_reduce")
    assert (stuck["joined"], stuck["missing"]) == ([0], [1])
    (culprit,) = report["culprits"]
    assert culprit["rank"] == 1
    assert culprit["reason"] == "never joined all_reduce #6 of group default_pg (pg 0): it waits on no collective"
    last = culprit["last_collective"]  # its newest entry: the all-reduce of NCCL group 1, done in 14 us on the GPU
    assert (last["group"], last["seq"], last["op"], last["state"]) == ("pg 1", 1, "all_reduce", "completed")
    assert last["duration_s"] == pytest.approx(1.3696e-5)
    assert report["summary"] == "rank 1 never joined all_reduce #6 on default_pg: ranks 0 wait for it"
    read = msgspec.json.decode(json.dumps(report), type=FlightAnalysis)
    assert read.culprits[0].last_collective is not None
    assert "in 0.0137 ms on the GPU" in describe(read.culprits[0].last_collective)


def test_a_rank_dumps_what_each_backend_recorded(tmp_path: Path) -> None:
    raw = pickle.dumps(nccl_trace(), protocol=2)  # torch's dump functions return pickled bytes

    def nccl(**options: bool) -> bytes:  # as _dump_nccl_trace
        assert options == {"includeCollectives": True, "includeStackTraces": True, "onlyActive": False}
        return raw

    def gloo(**options: bool) -> bytes:  # as _dump_fr_trace on a world with no gloo collective
        return pickle.dumps({"version": "2.10", "pg_config": {}, "pg_status": {}, "entries": []}, protocol=2)

    recorder = FlightRecorder("gpu", 0, 1, directory=str(tmp_path), dumpers={"gloo": gloo, "nccl": nccl})
    path = recorder.dump("incident-1")
    assert isinstance(path, Path)  # written to the directory (not sent to an agent)
    assert recorder.errors == 0
    body = json.loads(path.read_text())
    assert body["trace"]["entries"] == []
    entries = body["nccl_trace"]["entries"]
    assert len(entries) == 7
    assert [e["record_id"] for e in entries if "frames" in e] == [5, 6]  # the newest of each group keeps its stack
    kept = decode_dump(path.read_bytes())  # what the controller accepts
    assert read_dump(0, kept, (0,)).groups[("0", (0,))].completed == 6


def test_a_kept_dump_that_does_not_decode_is_left_out_and_its_rank_sent_none(caplog: pytest.LogCaptureFixture) -> None:
    """A dump the API took before its schema was a struct (or a store edited by hand) that does not fit: the
    analysis leaves it out, says so, and reads the rank as one that sent no dump."""
    good = json.dumps(dump(0, 2, nccl_trace()))
    bad = json.dumps({"trace": {"entries": [{"process_group": 3}, "x"], "pg_status": []}})
    rows = [FlightDumpRow("gpu", "incident-1", rank, 1, 0.0, body) for rank, body in ((0, good), (1, bad))]

    dumps = kept(rows)

    assert list(dumps) == [0]
    assert "the dump of rank 1 for incident-1 is left out" in caplog.text
    report = analyze(dumps, [0, 1], "incident-1", 1)
    assert [c.rank for c in report.culprits] == [1]
    assert report.culprits[0].reason == "sent no dump"
