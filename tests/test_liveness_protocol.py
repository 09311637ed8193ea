"""The liveness datagram and its acknowledgement (docs/protocol.md, "Liveness datagram"): the tag is HMAC-SHA256,
what decodes, and the rule each bad datagram breaks."""

from __future__ import annotations

import hmac

import pytest

from opsd.protocol.liveness import (
    ACK_BYTES,
    MAX_NODE_BYTES,
    LivenessError,
    Signer,
    decode_ack,
    decode_alive,
    encode_ack,
    encode_alive,
    liveness_key,
)

AGENT, OTHER = Signer(liveness_key("agent-token")), Signer(liveness_key("another-token"))


@pytest.mark.parametrize(
    ("key", "data", "mac_hex"),
    [
        (b"Jefe", b"what do ya want for nothing?", "5bdcc146bf60754e6a042426089575c7"),
        (
            b"\xaa" * 131,  # longer than the hash's block: hashed first
            b"Test Using Larger Than Block-Size Key - Hash Key First",
            "60e431591ee0b67f0d8a26aacbf5b77f",
        ),
    ],
    ids=["rfc4231-case-2", "rfc4231-case-6-long-key"],
)
def test_the_tag_is_hmac_sha256_truncated_to_16_bytes(key: bytes, data: bytes, mac_hex: str) -> None:
    assert Signer(key).tag(data).hex() == mac_hex
    assert Signer(key).tag(data) == hmac.digest(key, data, "sha256")[:16]


def test_a_signed_datagram_decodes_with_its_key_among_others() -> None:
    data = encode_alive("node-00042.rack-7", 1_800_000_000_123, AGENT)
    node, seq, tag = decode_alive(data, [OTHER, AGENT])
    assert (node, seq, tag) == ("node-00042.rack-7", 1_800_000_000_123, data[-16:])
    assert len(data) < 64  # a few tens of bytes


def test_the_acknowledgement_echoes_seq_and_tag() -> None:
    data = encode_ack(17, b"t" * 16)
    assert len(data) == ACK_BYTES
    assert decode_ack(data) == (17, b"t" * 16)


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes((data[at] ^ 1,)) + data[at + 1 :]


GOOD = encode_alive("node-1", 5, AGENT)
BAD = {
    "empty": (b"", "malformed"),
    "garbage": (b"\x00" * 40, "malformed"),
    "a heartbeat's JSON": (b'{"v": 1, "node": "node-1", "time_unix_s": 1.0, "ranks": []}', "malformed"),
    "too long": (GOOD + b"x" * 300, "malformed"),
    "truncated": (GOOD[:-1], "malformed"),
    "an acknowledgement": (encode_ack(5, GOOD[-16:]) + b"\x00" * 8, "malformed"),
    "version 2": (GOOD[:4] + b"\x02" + GOOD[5:], "version"),
    "another key": (encode_alive("node-1", 5, OTHER), "mac"),
    "a bit flipped in the seq": (flip(GOOD, 10), "mac"),
    "a bit flipped in the node": (flip(GOOD, 16), "mac"),
    "a bit flipped in the tag": (flip(GOOD, len(GOOD) - 1), "mac"),
    "the name's length lies": (GOOD[:14] + bytes((GOOD[14] + 1,)) + GOOD[15:], "malformed"),
}


@pytest.mark.parametrize(("data", "reason"), list(BAD.values()), ids=list(BAD))
def test_bad_datagrams_are_refused_with_the_rule_they_break(data: bytes, reason: str) -> None:
    with pytest.raises(LivenessError) as refused:
        decode_alive(data, [AGENT])
    assert refused.value.reason == reason


@pytest.mark.parametrize(
    "node", ["-leading-dash", "new\nline", "sp ace", "é"], ids=["dash", "newline", "space", "utf8"]
)
def test_a_signed_datagram_with_a_bad_node_name_is_refused(node: str) -> None:
    with pytest.raises(LivenessError, match="node name") as refused:
        decode_alive(encode_alive(node, 5, AGENT), [AGENT])
    assert refused.value.reason == "malformed"


def test_a_node_name_must_fit_and_bad_acknowledgements_are_refused() -> None:
    with pytest.raises(ValueError, match="1 to 200 bytes"):
        encode_alive("n" * (MAX_NODE_BYTES + 1), 1, AGENT)
    for data in (b"", GOOD, encode_ack(1, b"t" * 16)[:-1], b"xxxx" + encode_ack(1, b"t" * 16)[4:]):
        with pytest.raises(LivenessError):
            decode_ack(data)
