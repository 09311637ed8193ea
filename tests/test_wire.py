"""The step report's wire format (docs/protocol.md): what decodes, and the rule each bad datagram breaks."""

from __future__ import annotations

import json
from typing import Any

import pytest

from trainer_hooks.wire import MAX_MESSAGE_BYTES, STEP_FIELDS, VERSION, WireError, decode, encode


def report(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "v": VERSION,
        "kind": "step",
        "run": "r",
        "rank": 3,
        "world_size": 4,
        "host": "node-0",
        "step": 7,
        "time_unix_s": 1.5e9,
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


def raw(message: dict[str, Any]) -> bytes:
    return json.dumps(message).encode()


def test_round_trip() -> None:
    assert decode(encode(report())) == report()


def test_unknown_fields_are_kept_for_newer_senders() -> None:
    assert decode(raw(report(gpu_uuid="GPU-1")))["gpu_uuid"] == "GPU-1"


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


BAD: dict[str, tuple[bytes, str]] = {
    "too large": (b" " * (MAX_MESSAGE_BYTES + 1), "exceeds"),
    "not json": (b"{nope", "not JSON"),
    "not utf-8": (b"\xff\xfe", "not JSON"),
    "array": (b"[1, 2]", "not a JSON object"),
    "old version": (raw(report(v=0)), "unsupported version 0"),
    "no version": (b"{}", "unsupported version None"),
    "wrong kind": (raw(report(kind="heartbeat")), "unknown kind"),
    "missing step_s": (missing("step_s"), "missing field 'step_s'"),
    "string rank": (raw(report(rank="3")), "field 'rank' has type str"),
    "bool tokens": (raw(report(tokens=True)), "field 'tokens' has type bool"),
    "infinite step": (raw(report(step_s=float("inf"))), "'step_s' is not finite"),
    "nan mfu": (raw(report(mfu_ratio=float("nan"))), "'mfu_ratio' is not finite"),
    "short comms entry": (raw(report(comms=[["tp", "all_reduce", 1]])), "comms entries"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_datagrams_are_rejected_with_their_rule(name: str) -> None:
    data, message = BAD[name]
    with pytest.raises(WireError, match=message):
        decode(data)


def test_every_field_is_required() -> None:
    for name in STEP_FIELDS:
        with pytest.raises(WireError, match=f"missing field '{name}'|unsupported version"):
            decode(missing(name))
