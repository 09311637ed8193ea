"""What the API's process shares with the worker processes it starts (``opsd.api.liveness_worker``,
``opsd.api.heartbeat_worker``): messages framed on a pipe, and the start of a worker.

A frame is the message's length (4 bytes, big-endian), then the message in msgpack. A worker is started with its
sockets and pipes as inherited file descriptors and its settings (msgpack) on standard input, so that no key is on
a command line, with this opsd found last on its path (after the interpreter's own: nothing shadowed).
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Generic, TypeVar

import msgspec

import opsd

log = logging.getLogger(__name__)

FRAME = struct.Struct("!I")
#: a pipe's room: ~4 s of 12,288 liveness datagrams a second, or ~1 s of the heartbeats of 12,288 nodes
PIPE_BYTES = 1 << 20
_RUN_WORKER = (
    "import importlib, sys; sys.path.append(sys.argv.pop(1)); sys.exit(importlib.import_module(sys.argv.pop(1)).main())"
)

M = TypeVar("M", bound=msgspec.Struct)


def encode_frame(message: msgspec.Struct) -> bytes:
    data = msgspec.msgpack.encode(message)
    return FRAME.pack(len(data)) + data


class Frames(Generic[M]):
    """The reading end: bytes in as they come, whole messages of ``kind`` out."""

    def __init__(self, kind: type[M]) -> None:
        self._buffer = bytearray()
        self._decoder = msgspec.msgpack.Decoder(kind)

    def feed(self, data: bytes) -> list[M]:
        """The messages ``data`` completes; a frame that does not decode is dropped, and raises
        ``msgspec.DecodeError`` (the frames after it are read on the next call)."""
        self._buffer += data
        messages = []
        while len(self._buffer) >= FRAME.size:
            (size,) = FRAME.unpack_from(self._buffer)
            end = FRAME.size + size
            if len(self._buffer) < end:
                break
            frame = bytes(self._buffer[FRAME.size : end])
            del self._buffer[:end]
            messages.append(self._decoder.decode(frame))
        return messages


def pipe() -> tuple[int, int]:
    """A pipe (reading end, writing end) with room for ``PIPE_BYTES`` where the kernel allows."""
    read_fd, write_fd = os.pipe()
    try:
        fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except OSError as exc:  # capped by /proc/sys/fs/pipe-max-size: the default 64 KiB then
        log.debug("a worker's pipe size: %s", exc)
    return read_fd, write_fd


def start(module: str, fds: dict[str, int], settings: msgspec.Struct) -> subprocess.Popen[bytes]:
    """``python -m module`` in effect, given ``--<name>-fd N`` for each of ``fds`` (inherited), ``--parent-pid``,
    and ``settings`` on standard input."""
    source = str(Path(opsd.__file__).resolve().parents[1])  # this opsd: last on the path, where nothing else has it
    command = [sys.executable, "-c", _RUN_WORKER, source, module, "--parent-pid", str(os.getpid())]
    for name, fd in fds.items():
        command += [f"--{name}-fd", str(fd)]
    worker = subprocess.Popen(command, stdin=subprocess.PIPE, pass_fds=tuple(fds.values()))
    assert worker.stdin is not None
    with worker.stdin:
        worker.stdin.write(msgspec.msgpack.encode(settings))
    return worker
