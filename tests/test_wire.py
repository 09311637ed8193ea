"""The wire format (docs/protocol.md): what decodes, and the rule each bad datagram breaks."""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
import pytest

from opsd.protocol.wire import (
    MAX_MESSAGE_BYTES,
    STEP_FIELDS,
    VERSION,
    ActivityReport,
    StepReport,
    TimeoutReport,
    WireError,
    decode,
    decode_report,
    encode,
    pipeline_bubble_ratio,
)

#: what both kinds of report carry alike: the version, the run, the host, the step and when it was sent
SENDER: dict[str, Any] = {"v": VERSION, "run": "r", "host": "node-0", "step": 7, "time_unix_s": 1.5e9}


def report(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        **SENDER,
        "kind": "step",
        "rank": 3,
        "world_size": 4,
        "step_s": 0.2,
        "compute_s": 0.15,
        "exposed_comm_s": 0.05,
        "overlapped_comm_s": 0.01,
        "tokens": 512,
        "tokens_per_s": 2560.0,
        "job_tokens_per_s": 5120.0,
        "mfu_ratio": 0.4,
        "memory": {"rss_bytes": 1 << 30},
        "coords": {"dp_shard": 1, "tp": 1},
        "comms": [["tp", "all_reduce", 28, 917504, 0.01]],
        "dropped_reports_total": 0,
        "internal_errors_total": 0,
    }
    base.update(changes)
    return base


def timeout_report(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        **SENDER,
        "kind": "collective_timeout",
        "rank": 1,
        "dim": "tp",
        "op": "all_reduce",
        "waited_s": 301.5,
    }
    base.update(changes)
    return base


def raw(message: dict[str, Any]) -> bytes:
    return json.dumps(message).encode()


def test_round_trip() -> None:
    assert decode(encode(report())) == report()


def test_a_collective_timeout_is_a_message_of_its_own_kind() -> None:
    decoded = decode_report(encode(timeout_report()))
    assert isinstance(decoded, TimeoutReport)
    assert (decoded.rank, decoded.dim, decoded.op, decoded.waited_s) == (1, "tp", "all_reduce", 301.5)
    assert decode(encode(timeout_report())) == timeout_report()


@pytest.mark.parametrize(
    ("changes", "field"),
    [({"run": "a run"}, "$.run"), ({"run": ""}, "$.run"), ({"op": "x" * 65}, "$.op"), ({"rank": -1}, "$.rank")],
)
def test_a_timeout_its_agent_could_not_send_on_is_refused_at_the_agent(changes: dict[str, Any], field: str) -> None:
    """The heartbeat carries the same struct (``CollectiveWait``): what the controller would refuse, whole heartbeat
    and all, the agent refuses first, for this one message."""
    with pytest.raises(WireError, match=re.escape(field)) as info:
        decode_report(encode({**timeout_report(), **changes}))
    assert info.value.reason == "field"
    wait = decode_report(encode(timeout_report()))
    assert isinstance(wait, TimeoutReport)
    assert msgspec.to_builtins(wait.wait()) == {
        k: v for k, v in timeout_report().items() if k not in ("v", "kind", "host")
    }


@pytest.mark.parametrize("what", ["checkpoint", "closing", ""])
def test_an_activity_is_a_message_of_its_own_kind(what: str) -> None:
    sent = {"v": VERSION, "kind": "activity", "run": "r", "rank": 3, "host": "node-0", "time_unix_s": 1.5e9}
    decoded = decode_report(encode({**sent, "activity": what}))
    assert isinstance(decoded, ActivityReport)
    assert (decoded.rank, decoded.activity) == (3, what)


@pytest.mark.parametrize(
    ("changes", "reason", "named"),
    [
        ({"activity": "sleeping"}, "field", "$.activity"),
        ({"rank": "3"}, "field", "$.rank"),
        ({"v": 2}, "version", "$.v"),
        ({"kind": "gossip"}, "kind", "$.kind"),
        ({"kind": 7}, "kind", "$.kind"),
    ],
)
def test_a_bad_activity_is_refused_naming_the_rule(changes: dict[str, Any], reason: str, named: str) -> None:
    sent = {"v": VERSION, "kind": "activity", "run": "r", "rank": 3, "host": "h", "time_unix_s": 1.0, "activity": ""}
    with pytest.raises(WireError, match=re.escape(named)) as info:
        decode_report(encode({**sent, **changes}))
    assert info.value.reason == reason


def test_unknown_fields_are_accepted_for_newer_senders() -> None:
    assert decode(raw(report(gpu_uuid="GPU-1")))["gpu_uuid"] == "GPU-1"
    assert decode_report(raw(report(gpu_uuid="GPU-1"))).rank == 3


def test_oversized_report_is_sent_without_comms_detail() -> None:
    big = report(comms=[["tp", f"op{i}", 1, 1, 0.0] for i in range(1000)])
    data = encode(big)
    assert len(data) <= MAX_MESSAGE_BYTES
    decoded = decode(data)
    assert decoded["truncated"] is True
    assert decoded["comms"] == []


def missing(name: str) -> bytes:
    message = report()
    del message[name]
    return raw(message)


BAD: dict[str, tuple[bytes, str, str]] = {  # name: (datagram, reason, part of the message)
    "too large": (b" " * (MAX_MESSAGE_BYTES + 1), "too_large", "exceeds"),
    "not json": (b"{nope", "not_json", "not JSON"),
    "not utf-8": (b"\xff\xfe", "not_json", "not JSON"),
    "array": (b"[1, 2]", "not_object", "Expected `object`, got `array`"),
    "old version": (raw(report(v=0)), "version", "unsupported version"),
    "no version": (b"{}", "version", "missing required field `v`"),
    "wrong kind": (raw(report(kind="heartbeat")), "kind", "'heartbeat' - at `$.kind`"),
    "missing step_s": (missing("step_s"), "field", "missing required field `step_s`"),
    "string rank": (raw(report(rank="3")), "field", "Expected `int`, got `str` - at `$.rank`"),
    "bool tokens": (raw(report(tokens=True)), "field", "got `bool` - at `$.tokens`"),
    "negative rank": (raw(report(rank=-1)), "field", "`$.rank`"),
    "infinite step": (raw(report(step_s=float("inf"))), "not_json", "not JSON"),
    "huge step": (raw(report(step_s=1e999)), "not_json", "not JSON"),
    "nan mfu": (raw(report(mfu_ratio=float("nan"))), "not_json", "not JSON"),
    "short comms entry": (raw(report(comms=[["tp", "all_reduce", 1]])), "comms", "`$.comms[0]`"),
    "negative comms bytes": (raw(report(comms=[["tp", "all_reduce", 1, -8, 0.0]])), "comms", "`$.comms[0][3]`"),
    "memory of strings": (raw(report(memory={"rss_bytes": "1"})), "field", "`$.memory"),
    "timeout without op": (raw({k: v for k, v in timeout_report().items() if k != "op"}), "field", "field `op`"),
    "timeout of a negative wait": (raw(timeout_report(waited_s=-1.0)), "field", "`$.waited_s`"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_datagrams_are_rejected_with_their_rule(name: str) -> None:
    data, reason, message = BAD[name]
    with pytest.raises(WireError, match=re.escape(message)) as info:
        decode(data)
    assert info.value.reason == reason


def test_every_field_is_required() -> None:
    for name in STEP_FIELDS:
        with pytest.raises(WireError, match=f"missing required field `{name}`"):
            decode(missing(name))


def test_a_pipeline_stage_reports_its_bubble_and_schedule_and_older_receivers_ignore_it() -> None:
    sent = report(pipeline={"bubble_s": 0.05, "schedule": "1f1b", "stages": 4, "microbatches": 8})
    decoded = decode_report(encode(sent))
    assert isinstance(decoded, StepReport)
    assert decoded.pipeline is not None
    assert (decoded.pipeline.bubble_s, decoded.pipeline.schedule, decoded.pipeline.stages) == (0.05, "1f1b", 4)
    assert pipeline_bubble_ratio(decoded) == pytest.approx(0.25)
    bare = decode_report(encode(report(pipeline={"bubble_s": 0.01})))  # a trainer that did not name its schedule
    assert isinstance(bare, StepReport)
    assert bare.pipeline is not None
    assert (bare.pipeline.schedule, bare.pipeline.stages, bare.pipeline.microbatches) == ("", 0, 0)
    without = decode_report(encode(report()))
    assert isinstance(without, StepReport)
    assert without.pipeline is None
    assert pipeline_bubble_ratio(without) is None


@pytest.mark.parametrize(
    "pipeline",
    [{"bubble_s": -0.1}, {"schedule": "1f1b"}, {"bubble_s": 0.1, "stages": -1}, {"bubble_s": 0.1, "schedule": "a b"}],
)
def test_a_bad_pipeline_part_is_refused_by_field(pipeline: dict[str, Any]) -> None:
    with pytest.raises(WireError, match=r"\$\.pipeline") as caught:
        decode_report(encode(report(pipeline=pipeline)))
    assert caught.value.reason == "field"


FT = {
    "replica_group": 1,
    "replica_groups": 2,
    "quorum_id": 4,
    "quorum_replicas": 2,
    "participants": 1,
    "committed": True,
    "healing_s": 0.03,
    "quorum_wait_s": 0.5,
}


def test_a_replica_group_rank_reports_its_quorum_and_older_receivers_ignore_it() -> None:
    decoded = decode_report(encode(report(ft=FT)))
    assert isinstance(decoded, StepReport)
    assert decoded.ft is not None
    assert (decoded.ft.replica_group, decoded.ft.quorum_replicas, decoded.ft.participants) == (1, 2, 1)
    assert (decoded.ft.healing_s, decoded.ft.quorum_wait_s, decoded.ft.committed) == (0.03, 0.5, True)
    bare = decode_report(encode(report(ft={k: v for k, v in FT.items() if k not in ("committed", "healing_s")})))
    assert isinstance(bare, StepReport)
    assert bare.ft is not None
    assert (bare.ft.committed, bare.ft.healing_s, bare.ft.quorum_wait_s) == (True, 0.0, 0.5)
    without = decode_report(encode(report()))
    assert isinstance(without, StepReport)
    assert without.ft is None


@pytest.mark.parametrize(
    "change",
    [
        {"healing_s": -0.1},
        {"quorum_replicas": -1},
        {"committed": "yes"},
        {"replica_group": None},
        {"quorum_wait_s": "1"},
    ],
)
def test_a_bad_quorum_is_refused_by_field(change: dict[str, Any]) -> None:
    with pytest.raises(WireError, match=r"\$\.ft") as caught:
        decode_report(encode(report(ft={**FT, **change})))
    assert caught.value.reason == "field"
