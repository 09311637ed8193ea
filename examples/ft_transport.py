"""The state a replica group serves a healing peer, over torchft's HTTP checkpoint transport, with what a healthy group
serving a healer must never do taken out (``examples.ft``): wait for the healer, or let it read state the next step
is writing.
"""

from __future__ import annotations

import contextlib
import io
import logging
import threading
import time
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten
from torchft.checkpointing._serialization import _streaming_load
from torchft.checkpointing.http_transport import HTTPTransport

from opsd.protocol.ft import HEAL_MIN_BYTES_PER_S

log = logging.getLogger(__name__)


class Gate:
    """What the HTTP transport's request handler takes for each request, in place of torchft's read-write lock: a
    request waits (up to the timeout) while no checkpoint is allowed, and disallowing never waits for a request
    being served. torchft's lock made ``disallow_checkpoint`` (inside ``should_commit``, every step) wait for every
    request being served, then raise ``TimeoutError`` into the training loop: a healer that read slowly crashed the
    healthy group that served it. Here a request serves a snapshot the group no longer writes to
    (``PeerTransport.send_checkpoint``), so nothing needs to wait for it."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._open = threading.Event()

    @contextlib.contextmanager
    def r_lock(self) -> Iterator[None]:
        if not self._open.wait(self.timeout_s):
            raise TimeoutError(f"no checkpoint allowed within {self.timeout_s} s")
        yield

    def w_acquire(self) -> None:
        self._open.clear()

    def w_release(self) -> None:
        self._open.set()


def snapshot(state: Any) -> Any:
    """``state`` with each tensor in host memory copied: what a healer reads is not what the next optimizer step
    writes (torchft copies a GPU tensor to the host itself; a tensor already there it would serve as it is)."""
    values, spec = tree_flatten(state)
    copied = [v.detach().clone() if isinstance(v, torch.Tensor) and v.device.type == "cpu" else v for v in values]
    return tree_unflatten(copied, spec)


class Throttled(io.RawIOBase):
    """A response read at most ``bytes_per_s`` (fault injection: a healer on a slow link)."""

    def __init__(self, raw: Any, bytes_per_s: float) -> None:
        self._raw = raw
        self._bytes_per_s = bytes_per_s
        self._start = time.monotonic()
        self._read = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer)[:65536]
        n = self._raw.readinto(view)
        self._read += n
        time.sleep(max(0.0, self._start + self._read / self._bytes_per_s - time.monotonic()))
        return int(n)


class Deadline(io.RawIOBase):
    """A response whose reading raises ``TimeoutError`` once past ``deadline_s`` (``time.monotonic``): the socket's
    timeout bounds each read, not the whole, and a healer on a slow link would hold its peers for as long as it
    reads."""

    def __init__(self, raw: Any, deadline_s: float, limit_s: float) -> None:
        self._raw = raw
        self._deadline_s = deadline_s
        self._limit_s = limit_s

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if time.monotonic() > self._deadline_s:
            raise TimeoutError(f"the peer's state not read within {self._limit_s:.1f} s")
        return int(self._raw.readinto(buffer))


class PeerTransport(HTTPTransport):  # type: ignore[misc]
    """torchft's HTTP checkpoint transport, with what a healthy group serving a healer must never do taken out: wait
    for the healer (``Gate``), or let it read state the next step is writing (``snapshot``), or be held by a healer
    that reads slowly for longer than its state's size calls for (``read_limit_s``: ``Deadline``). It also times what
    this rank spends fetching a peer's state (on the Manager's quorum thread), and can read slowly on purpose
    (``read_bytes_per_s``: fault injection)."""

    def __init__(
        self,
        timeout: timedelta,
        host: str,
        read_bytes_per_s: float | None = None,
        min_bytes_per_s: float = HEAL_MIN_BYTES_PER_S,
    ) -> None:
        if min_bytes_per_s <= 0:
            raise ValueError("the heal's minimum rate must be > 0 bytes/s")
        self.host = host  # where the other groups reach it (torchft's own: the bare host name); its server says it
        super().__init__(timeout=timeout, num_chunks=0)
        self._checkpoint_lock = Gate(timeout.total_seconds())  # closed: nothing is allowed before the first send
        self.read_bytes_per_s = read_bytes_per_s
        self.min_bytes_per_s = min_bytes_per_s
        self.state_bytes = 0  # the size of this rank's own state, which a peer's is (set by the trainer)
        self.gave_up = ""  # why a read of a peer's state was given up ("": none was)
        self.fetch_s = 0.0

    def address(self) -> str:
        return f"http://{self.host}:{self._server.socket.getsockname()[1]}/checkpoint/"

    def read_limit_s(self, timeout: timedelta) -> float:
        """How long a read of a peer's state may take: its size at the minimum rate, or ``timeout`` if longer."""
        return max(timeout.total_seconds(), self.state_bytes / self.min_bytes_per_s)

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        super().send_checkpoint(dst_ranks, step, snapshot(state_dict), timeout)

    def recv_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return super().recv_checkpoint(*args, **kwargs)
        finally:
            self.fetch_s += time.perf_counter() - start

    def _load_from_address(self, address: str, timeout: timedelta) -> object:
        limit_s = self.read_limit_s(timeout)
        deadline_s = time.monotonic() + limit_s
        if self.read_bytes_per_s is not None:
            log.warning("fault injection: reading the peer's state at %g bytes/s", self.read_bytes_per_s)
        with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
            raw = f if self.read_bytes_per_s is None else Throttled(f, self.read_bytes_per_s)
            try:
                return _streaming_load(io.BufferedReader(Deadline(raw, deadline_s, limit_s)), weights_only=False)
            except TimeoutError as exc:
                self.gave_up = str(exc)  # the trainer ends the group: a healer too slow holds its peers at each try
                raise
