"""The liveness datagrams' process: ``python -m opsd.api.liveness_worker``, started by the API (``opsd.api.liveness``).

It owns the UDP socket's reading: each datagram is checked (``opsd.protocol.liveness``: size, version, the tag of an
agent's or an operator's key; then its clock against ours, and a ``seq`` newer than the node's last), acknowledged at
once, and what was taken goes to the API's process in batches: every ``flush_s`` (50 ms) a frame on a pipe, the nodes
taken with their ``seq`` and the time each was taken, and what was refused by reason.

Why a process: at 12,288 nodes the datagrams come at 12,288 a second. On the API's event loop each one cost two socket
calls that let the interpreter lock go, and the loop waited for it again behind the HTTP heartbeats, the detection
thread and the collector: acknowledgements came back after up to 2 s (docs/controller.md, "Scale"). Here nothing else
runs, and the API's process takes 20 frames a second instead of 12,288 datagrams.

It ends when its parent does (the pipe is closed, or its parent process changes) or on SIGTERM. Started with the
socket and the pipe as inherited file descriptors, and its settings (``WorkerConfig``) on standard input
(``opsd.api.pipes``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import select
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import Sequence

import msgspec

from opsd.api.pipes import encode_frame
from opsd.protocol.liveness import MAX_DATAGRAM_BYTES, LivenessError, Signer, decode_alive, encode_ack

log = logging.getLogger(__name__)

DRAIN_MAX = 1024  # datagrams taken at most before the flush is looked at again


class WorkerConfig(msgspec.Struct, frozen=True):
    keys: list[bytes]  # the liveness keys of the tokens that may send heartbeats (``liveness_key``)
    max_skew_s: float  # a datagram whose clock is further than this from ours is refused (``skew``)
    flush_s: float = 0.05  # a batch at least this often while datagrams come


class Batch(msgspec.Struct, array_like=True):
    taken: list[tuple[str, int, float]]  # (node, seq, unix seconds when taken), in the order taken
    refused: dict[str, int]  # reason -> datagrams refused since the last batch


class Checker:
    """What the worker does with one datagram: (node, seq, tag) to acknowledge, or the reason it is refused."""

    def __init__(self, config: WorkerConfig) -> None:
        self.signers = [Signer(key) for key in config.keys]
        self.max_skew_s = config.max_skew_s
        self.last_seq: dict[str, int] = {}  # node -> the newest seq taken from it

    def check(self, data: bytes, now_s: float) -> tuple[str, int, bytes] | str:
        try:
            node, seq, tag = decode_alive(data, self.signers)
        except LivenessError as exc:
            return exc.reason
        if abs(seq / 1000.0 - now_s) > self.max_skew_s:
            return "skew"
        if seq <= self.last_seq.get(node, 0):
            return "replay"
        self.last_seq[node] = seq
        return node, seq, tag


def serve(sock: socket.socket, out_fd: int, config: WorkerConfig, parent_pid: int) -> None:
    """Take the datagrams of ``sock`` until the parent is gone; the batches to ``out_fd``."""
    checker = Checker(config)
    sock.setblocking(False)
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    taken: list[tuple[str, int, float]] = []
    refused: Counter[str] = Counter()
    due = time.monotonic() + config.flush_s
    while True:
        if poller.poll(max(0.0, due - time.monotonic()) * 1000.0):
            for _ in range(DRAIN_MAX):
                try:
                    data, addr = sock.recvfrom(MAX_DATAGRAM_BYTES + 1)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:  # an acknowledgement that found no one (ICMP unreachable), reported here
                    log.debug("liveness worker: %s", exc)
                    continue
                now_s = time.time()
                checked = checker.check(data, now_s)
                if isinstance(checked, str):
                    refused[checked] += 1
                    continue
                node, seq, tag = checked
                try:
                    sock.sendto(encode_ack(seq, tag), addr)
                except OSError as exc:  # a full send buffer: the node's next datagram is acknowledged instead
                    log.debug("liveness acknowledgement to %s: %s", addr, exc)
                taken.append((node, seq, now_s))
        if time.monotonic() < due:
            continue
        if taken or refused:
            # blocks while the pipe is full (the API's process is not taking them): then nothing is acknowledged
            # either, and agents fall back to heartbeats over HTTP
            os.write(out_fd, encode_frame(Batch(taken, dict(refused))))
            taken, refused = [], Counter()
        if os.getppid() != parent_pid:
            return
        due = time.monotonic() + config.flush_s


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="opsd.api.liveness_worker", description=__doc__.splitlines()[0])
    p.add_argument("--socket-fd", type=int, required=True, help="the bound UDP socket, inherited")
    p.add_argument("--out-fd", type=int, required=True, help="the pipe's writing end, inherited")
    p.add_argument("--parent-pid", type=int, required=True, help="ends when its parent is no longer this one")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        config = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=WorkerConfig)
    except msgspec.DecodeError as exc:
        log.error("liveness worker: its settings on standard input: %s", exc)
        return 2
    sock = socket.socket(fileno=args.socket_fd)
    with contextlib.suppress(BrokenPipeError):  # the API's process closed its end: it stops, or it is gone
        serve(sock, args.out_fd, config, args.parent_pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
