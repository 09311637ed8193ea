"""What the API's process shares with the worker processes it starts (``opsd.api.liveness_worker``,
``opsd.api.heartbeat_worker``): messages framed on a pipe, the start of a worker, and a worker seen from the API's
event loop (``WorkerProcess``).

A frame is the message's length (4 bytes, big-endian), then the message in msgpack. A worker is started with its
sockets and pipes as inherited file descriptors and its settings (msgpack) on standard input, so that no key is on
a command line, with this opsd found last on its path (after the interpreter's own: nothing shadowed).
"""

from __future__ import annotations

import asyncio
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
STOP_WAIT_S = 5.0
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


class WorkerProcess(Generic[M]):
    """A worker process seen from the API's event loop: its messages read off its pipe as they come, its end noticed
    and its exit status waited for on a thread (the event loop never waits: a worker that lingered would hold every
    request up for ``STOP_WAIT_S``), and its stop."""

    def __init__(self, process: subprocess.Popen[bytes], fd: int, kind: type[M], what: str, without: str) -> None:
        self.process = process
        self.fd = fd  # the reading end of its pipe
        self.frames = Frames(kind)
        self.what = what  # "the liveness worker", for the logs
        self.without = without  # what agents do without it, for the log of its end
        self.closing = False
        self.reaping: asyncio.Task[None] | None = None

    def read(self) -> list[M] | None:
        """The messages the pipe completes now; None when the worker has ended on its own (its end of the pipe
        closed): its status is then waited for and logged."""
        try:
            data = os.read(self.fd, PIPE_BYTES)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError as exc:
            log.error("reading what %s sends: %s", self.what, exc)
            data = b""
        if not data:
            asyncio.get_running_loop().remove_reader(self.fd)
            if not self.closing:
                self.reaping = asyncio.get_running_loop().create_task(self._reap())
            return None
        try:
            return self.frames.feed(data)
        except msgspec.DecodeError as exc:  # never from the worker of this version: a bug, said loudly
            log.error("%s sent a frame that does not decode: %s", self.what, exc)
            return []

    async def _reap(self) -> None:
        try:
            status: int | None = await asyncio.to_thread(self.process.wait, STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            status = None
        log.error("%s ended (exit status %s): %s", self.what, status, self.without)

    def stop(self) -> None:
        """Stop reading, and the worker (SIGTERM; SIGKILL after ``STOP_WAIT_S``)."""
        self.closing = True
        asyncio.get_running_loop().remove_reader(self.fd)
        self.process.terminate()
        try:
            self.process.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self.fd)
