"""The one thread that takes the heartbeats that may write to the state store, in batches.

A heartbeat whose node or run is new, or that carries GPU events, writes to the store; the others are taken on the
event loop, in memory. The store takes one write at a time anyway, so one thread does them all (on the default pool's
40 threads, 12,288 first heartbeats would fight over the interpreter lock and starve the event loop). When a job of
thousands of nodes starts, their first heartbeats come within seconds: the thread takes what has queued up (at most
``MAX_BATCH``), writes the batch's new runs and nodes in one transaction (``Controller.register``), then takes each
heartbeat, which finds them known. A commit per node would keep the store, and the thread, busy for as long as the
nodes keep coming.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable

from opsd.controller.controller import Controller
from opsd.errors import OpsError
from opsd.protocol.heartbeat import Heartbeat, HeartbeatReply

log = logging.getLogger(__name__)

MAX_BATCH = 512

_Item = tuple[Heartbeat, asyncio.AbstractEventLoop, "asyncio.Future[HeartbeatReply]"]
CLOSE_WAIT_S = 10.0


class HeartbeatWriter:
    def __init__(self, controller: Controller, clock: Callable[[], float]) -> None:
        self.controller = controller
        self.clock = clock
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()  # None: the end
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()

    async def take(self, body: Heartbeat) -> HeartbeatReply:
        """The reply to ``body``, once the writer thread has taken it; what taking it raised, raised here."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[HeartbeatReply] = loop.create_future()
        self._queue.put((body, loop, future))
        if self._thread is None:
            with self._start:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="opsd-heartbeat-writer", daemon=True)
                    self._thread.start()
        return await future

    def close(self) -> None:
        """Take what has queued up, then end the thread (the server stops): a thread cut off in the middle of a
        write by the interpreter's exit would crash the process."""
        with self._start:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(CLOSE_WAIT_S)

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            end = False
            while len(batch) < MAX_BATCH:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    end = True
                    break
                batch.append(item)
            if len(batch) > 1:
                try:
                    self.controller.register([body for body, _, _ in batch], self.clock())
                except OpsError as exc:  # each heartbeat then writes what it needs, and answers its own error
                    log.warning("registering %d heartbeats' nodes at once: %s", len(batch), exc)
            for body, loop, future in batch:
                try:
                    reply = self.controller.heartbeat(body, self.clock())
                except Exception as exc:
                    _hand_back(loop, _fail, future, exc)
                else:
                    _hand_back(loop, _answer, future, reply)
            if end:
                return


def _hand_back(loop: asyncio.AbstractEventLoop, how: Callable[..., None], *args: object) -> None:
    try:
        loop.call_soon_threadsafe(how, *args)
    except RuntimeError:  # its loop is closed: no one waits for the answer any more
        log.debug("a heartbeat's answer found its event loop closed")


def _answer(future: asyncio.Future[HeartbeatReply], reply: HeartbeatReply) -> None:
    if not future.done():  # its request may have been given up meanwhile
        future.set_result(reply)


def _fail(future: asyncio.Future[HeartbeatReply], exc: Exception) -> None:
    if not future.done():
        future.set_exception(exc)
