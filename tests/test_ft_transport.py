"""The healer's side of the trainer's checkpoint transport (``examples.ft_transport``): how long a read of a peer's
state may take, and a read that passes it ends."""

from __future__ import annotations

import io
import time
from datetime import timedelta

import pytest

from examples.ft_transport import Deadline, PeerTransport


@pytest.mark.parametrize(
    ("state_bytes", "limit_s"),
    [(0, 3.0), (4_000_000, 3.0), (40_000_000, 10.0)],
    ids=["no state known: the timeout", "small: the timeout", "its size at the minimum rate"],
)
def test_a_read_may_take_the_state_at_the_minimum_rate_or_the_timeout(state_bytes: int, limit_s: float) -> None:
    transport = PeerTransport(timedelta(seconds=3), "127.0.0.1", min_bytes_per_s=4e6)
    try:
        transport.state_bytes = state_bytes
        assert transport.read_limit_s(timedelta(seconds=3)) == pytest.approx(limit_s)
    finally:
        transport.shutdown(wait=False)


def test_a_minimum_rate_of_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="minimum rate"):
        PeerTransport(timedelta(seconds=3), "127.0.0.1", min_bytes_per_s=0)


def test_a_read_past_its_deadline_ends_with_a_timeout() -> None:
    live = io.BufferedReader(Deadline(io.BytesIO(b"x" * 100), time.monotonic() + 60, 60))
    assert live.read() == b"x" * 100
    late = io.BufferedReader(Deadline(io.BytesIO(b"x" * 100), time.monotonic() - 1, 2.5))
    with pytest.raises(TimeoutError, match=r"not read within 2\.5 s"):
        late.read()
