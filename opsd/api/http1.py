"""The heartbeat process's HTTP/1.1 server: one request handler called as each request's last byte is read, its reply
written in one piece, on keep-alive connections, over TCP or TLS.

Why not uvicorn, which the API runs: at 12,288 nodes its ASGI cycle (a task a request, the scope, the messages, the
head and the body written by a send each, which wakes the agent twice) and its parser's callbacks were a third of the
heartbeat process's samples besides the heartbeat's own work, for an endpoint that reads a small body and answers
from memory (docs/controller.md, "Scale"). The HTTP parsing is
``httptools`` (llhttp), the same parser as uvicorn's; the rest is asyncio's protocol and transport:

- requests on a connection are answered in order (pipelined ones too); a body over ``max_body_bytes`` is answered 413
  at once and the connection closed, as is a request that does not parse (400): both counted by ``refuse``
  (``too_large``, ``malformed``);
- a connection that sends nothing for ``keep_alive_s`` after a reply is closed (uvicorn's ``timeout_keep_alive``),
  unless its client is not reading its replies (below);
- ``Connection: close`` and HTTP/1.0 without keep-alive close after the reply, as does a request to upgrade the
  connection (answered as a plain request); ``Expect: 100-continue`` is answered ``100 Continue``;
- while a client does not read its replies (its transport's buffer full), its connection is not read either.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, cast

import httptools
import msgspec

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 2.0  # at the end, how long the connections closed may take to go


class Request(NamedTuple):
    method: str
    path: str  # without the query
    authorization: str | None
    body: bytes


class Reply(NamedTuple):
    status: int
    body: bytes  # JSON
    headers: list[tuple[bytes, bytes]]


Handler = Callable[[Request], Reply]
Refuse = Callable[[str], None]  # counts a request refused by the server, by reason


def reply_bytes(reply: Reply, close: bool) -> bytes:
    """The reply's status line, head and body in one piece."""
    phrase = http.HTTPStatus(reply.status).phrase.encode()
    head = [
        b"HTTP/1.1 %d %s\r\n" % (reply.status, phrase),
        b"content-type: application/json\r\ncontent-length: %d\r\n" % len(reply.body),
    ]
    head += [b"%s: %s\r\n" % header for header in reply.headers]
    if close:
        head.append(b"connection: close\r\n")
    return b"".join(head) + b"\r\n" + reply.body


def _error(status: int, detail: str) -> bytes:
    return reply_bytes(Reply(status, msgspec.json.encode({"detail": detail}), []), close=True)


@dataclass(frozen=True)
class Site:
    """What every connection of a server shares."""

    handler: Handler
    refuse: Refuse
    keep_alive_s: float
    max_body_bytes: int
    connections: set[Connection] = field(default_factory=set)  # those open


class Connection(asyncio.Protocol):
    """One client's connection: its requests parsed as bytes come, each answered by the handler when complete."""

    def __init__(self, site: Site) -> None:
        self.site = site
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.idle: asyncio.TimerHandle | None = None
        self.url = b""
        self.authorization: str | None = None
        self.body: list[bytes] = []
        self.size = 0
        self.keep = True  # the request's connection is kept for the next (HTTP/1.1 without "Connection: close")
        self.paused = False  # its replies are not read: its requests are not read either
        self.too_large = False  # the request's body is over max_body_bytes: answered 413, the connection closed

    # the transport's side
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's TCP transport, not a subclass of it
        self.site.connections.add(self)
        self._wait_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self.site.connections.discard(self)
        self._cancel_idle()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # answered as a plain request; nothing else is served on it
            self.close()
        except httptools.HttpParserError as exc:
            self.site.refuse("malformed")
            self._close_with(_error(400, f"not an HTTP/1.1 request: {exc}"))

    def pause_writing(self) -> None:
        """The client does not read its replies: its requests are not read either, and it is not idle."""
        self.paused = True
        self._cancel_idle()
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        if self.transport is not None:
            self.transport.resume_reading()
            self._wait_idle()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # the parser's side (httptools calls these from feed_data)
    def on_message_begin(self) -> None:
        self._cancel_idle()
        self.url, self.authorization, self.body, self.size = b"", None, [], 0

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        if lower == b"authorization":
            self.authorization = value.decode("latin-1")
        elif lower == b"expect" and value.lower() == b"100-continue" and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        elif lower == b"content-length" and value.isdigit() and int(value) > self.site.max_body_bytes:
            self._too_large()

    def on_headers_complete(self) -> None:
        self.keep = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size > self.site.max_body_bytes:
            self._too_large()
        elif not self.too_large:
            self.body.append(body)

    def on_message_complete(self) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        request = Request(
            self.parser.get_method().decode("latin-1"),
            httptools.parse_url(self.url).path.decode("latin-1"),
            self.authorization,
            b"".join(self.body),
        )
        self.body = []
        try:
            reply = self.site.handler(request)
        except Exception:  # a bug of the handler's: the client is answered, the server goes on
            log.exception("the heartbeat process's handler failed on %s %s", request.method, request.path)
            self._close_with(_error(500, "Internal Server Error"))
            return
        self.transport.write(reply_bytes(reply, close=not self.keep))
        if not self.keep:
            self.transport.close()
        elif not self.paused:
            self._wait_idle()

    # helpers
    def _wait_idle(self) -> None:
        self._cancel_idle()
        self.idle = asyncio.get_running_loop().call_later(self.site.keep_alive_s, self._idled)

    def _cancel_idle(self) -> None:
        if self.idle is not None:
            self.idle.cancel()
            self.idle = None

    def _idled(self) -> None:
        self.idle = None
        self.close()

    def _too_large(self) -> None:
        """Answered at once, without reading the rest (what the parser still calls back with is dropped)."""
        if not self.too_large:
            self.too_large, self.body = True, []
            self.site.refuse("too_large")
            self._close_with(_error(413, f"a body is at most {self.site.max_body_bytes} bytes"))

    def _close_with(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)
            self.transport.close()


def tls_context(certfile: str, keyfile: str) -> ssl.SSLContext | None:
    """The server's TLS context for a certificate and its key (None: plain TCP)."""
    if not certfile:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certfile, keyfile or None)
    return context


async def serve(
    sock: socket.socket,
    handler: Handler,
    *,
    refuse: Refuse,
    stop: asyncio.Event,
    keep_alive_s: float,
    max_body_bytes: int,
    backlog: int,
    tls: ssl.SSLContext | None = None,
) -> None:
    """Serve ``handler`` on the listening ``sock`` until ``stop`` is set; then the connections are closed."""
    site = Site(handler, refuse, keep_alive_s, max_body_bytes)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: Connection(site),
        sock=sock,
        ssl=tls,
        backlog=backlog,
    )
    try:
        await stop.wait()
    finally:
        server.close()
        for connection in list(site.connections):
            connection.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.wait_closed(), CLOSE_WAIT_S)
