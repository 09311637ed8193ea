"""The heartbeat process's HTTP/1.1 server (``opsd.api.http1``), served on uvloop in a thread and spoken to over real
sockets: pipelined requests answered in order, keep-alive and its idle limit, ``Connection: close``, ``Expect:
100-continue``, a body too large and bytes that are not HTTP refused and counted, a handler's failure answered 500
without ending the server, a client that does not read its replies held off without losing one, and the stop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import uvloop

from opsd.api import http1
from opsd.api.http1 import Reply, Request

MAX_BODY_BYTES = 1024
KEEP_ALIVE_S = 1.0
BUFFER_BYTES = 8192
HELD_OFF_S = 1.0  # a client's socket not writable for this long: the server has stopped reading it


@dataclass
class Served:
    port: int
    refused: Counter[str]
    seen: list[Request]
    loop: asyncio.AbstractEventLoop
    stop: asyncio.Event
    connections: list[int] = field(default_factory=list)


def handler(seen: list[Request]) -> http1.Handler:
    def handle(request: Request) -> Reply:
        seen.append(request)
        if request.path == "/fail":
            raise RuntimeError("a bug of the handler's")
        payload = {"path": request.path, "method": request.method, "auth": request.authorization, "n": len(seen)}
        return Reply(200, json.dumps(payload).encode(), [(b"x-echo", request.body[:10])])

    return handle


@pytest.fixture
def served() -> Iterator[Served]:
    sock = socket.socket()
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):  # small, as the connections accepted inherit them: a client
        sock.setsockopt(socket.SOL_SOCKET, option, BUFFER_BYTES)  # that does not read fills them soon
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    refused: Counter[str] = Counter()
    seen: list[Request] = []
    ready = threading.Event()
    box: dict[str, object] = {}

    async def main() -> None:
        box["loop"], box["stop"] = asyncio.get_running_loop(), asyncio.Event()
        ready.set()
        stop = box["stop"]
        assert isinstance(stop, asyncio.Event)
        await http1.serve(
            sock,
            handler(seen),
            refuse=lambda reason: refused.update([reason]),
            stop=stop,
            keep_alive_s=KEEP_ALIVE_S,
            max_body_bytes=MAX_BODY_BYTES,
            backlog=16,
        )
        box["ended"] = True

    thread = threading.Thread(target=uvloop.run, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(10)
    loop, stop = box["loop"], box["stop"]
    assert isinstance(loop, asyncio.AbstractEventLoop)
    assert isinstance(stop, asyncio.Event)
    yield Served(sock.getsockname()[1], refused, seen, loop, stop)
    with contextlib.suppress(RuntimeError):  # its loop already ended (the test stopped it)
        loop.call_soon_threadsafe(stop.set)
    thread.join(10)
    assert box.get("ended"), "the server did not end when told to stop"


def post(path: str = "/v1/heartbeat", body: bytes = b"{}", extra: str = "") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer t\r\ncontent-length: {len(body)}\r\n{extra}\r\n"
    return head.encode() + body


def read_reply(conn: socket.socket, buffer: bytearray) -> tuple[bytes, bytes] | None:
    """(head, body) of the next reply on ``conn``; None when it closed first."""
    while True:
        end = buffer.find(b"\r\n\r\n")
        if end >= 0:
            head = bytes(buffer[:end])
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                ),
                0,
            )
            if len(buffer) >= end + 4 + length:
                body = bytes(buffer[end + 4 : end + 4 + length])
                del buffer[: end + 4 + length]
                return head, body
        data = conn.recv(65536)
        if not data:
            return None
        buffer += data


CHUNKED = b"POST /v1/heartbeat HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"


def connect(served: Served) -> socket.socket:
    return socket.create_connection(("127.0.0.1", served.port), timeout=10)


def test_pipelined_requests_are_answered_in_order_on_one_kept_connection(served: Served) -> None:
    with connect(served) as conn:
        conn.sendall(post("/v1/heartbeat?x=1", b"first") + post("/two", b"second") + post(body=b"third"))
        buffer = bytearray()
        replies = [read_reply(conn, buffer) for _ in range(3)]
        assert all(r is not None for r in replies)
        heads = [r[0] for r in replies if r is not None]
        bodies = [json.loads(r[1]) for r in replies if r is not None]
        assert [b["path"] for b in bodies] == ["/v1/heartbeat", "/two", "/v1/heartbeat"]  # the query is not the path
        assert [b["n"] for b in bodies] == [1, 2, 3]
        assert all(h.startswith(b"HTTP/1.1 200 OK\r\n") and b"content-type: application/json" in h for h in heads)
        assert [h.split(b"x-echo: ")[1] for h in heads] == [b"first", b"second", b"third"]
        assert not any(b"connection: close" in h for h in heads)
        assert [r.body for r in served.seen] == [b"first", b"second", b"third"]
        assert served.seen[0].authorization == "Bearer t"
        assert served.seen[0].method == "POST"
        conn.sendall(post(body=b"fourth"))  # still open
        again = read_reply(conn, buffer)
        assert again is not None
        assert json.loads(again[1])["n"] == 4
    assert not served.refused


def test_an_idle_connection_is_closed_after_the_keep_alive(served: Served) -> None:
    with connect(served) as conn:
        conn.sendall(post())
        buffer = bytearray()
        assert read_reply(conn, buffer) is not None
        conn.settimeout(KEEP_ALIVE_S * 10)
        assert conn.recv(10) == b""  # closed by the server, within the socket's timeout


def test_connection_close_and_expect_continue(served: Served) -> None:
    with connect(served) as conn:
        conn.sendall(post(extra="connection: close\r\n"))
        buffer = bytearray()
        reply = read_reply(conn, buffer)
        assert reply is not None
        assert b"connection: close" in reply[0]
        assert read_reply(conn, buffer) is None
    with connect(served) as conn:
        conn.sendall(b"GET /v1/heartbeat HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n")
        buffer = bytearray()
        reply = read_reply(conn, buffer)
        assert reply is not None
        assert json.loads(reply[1])["method"] == "GET"  # answered as a plain request, then closed
        assert read_reply(conn, buffer) is None
    with connect(served) as conn:
        head = post(body=b"x" * 10).split(b"\r\n\r\n")[0] + b"\r\nexpect: 100-continue\r\n\r\n"
        conn.sendall(head)
        assert conn.recv(64).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        conn.sendall(b"x" * 10)
        reply = read_reply(conn, bytearray())
        assert reply is not None
        assert reply[0].startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize(
    ("request_bytes", "status", "reason"),
    [
        (post(body=b"x" * (MAX_BODY_BYTES + 1)), 413, "too_large"),
        (CHUNKED + (b"200\r\n" + b"x" * 512 + b"\r\n") * 3 + b"0\r\n\r\n", 413, "too_large"),
        (b"\x16\x03\x01 not http at all\r\n\r\n", 400, "malformed"),
    ],
    ids=["content-length over the limit", "chunks over the limit", "not HTTP"],
)
def test_what_the_server_refuses_is_answered_counted_and_closed(
    served: Served, request_bytes: bytes, status: int, reason: str
) -> None:
    with connect(served) as conn:
        conn.sendall(request_bytes)
        buffer = bytearray()
        reply = read_reply(conn, buffer)
        assert reply is not None
        assert reply[0].startswith(f"HTTP/1.1 {status} ".encode())
        assert json.loads(reply[1])["detail"]
        assert read_reply(conn, buffer) is None  # closed
    assert served.refused == Counter({reason: 1})
    assert not served.seen  # the handler never saw it


def test_a_handler_that_fails_is_answered_500_and_the_server_goes_on(served: Served) -> None:
    with connect(served) as conn:
        conn.sendall(post("/fail"))
        reply = read_reply(conn, bytearray())
        assert reply is not None
        assert reply[0].startswith(b"HTTP/1.1 500 ")
    with connect(served) as conn:
        conn.sendall(post())
        reply = read_reply(conn, bytearray())
        assert reply is not None
        assert reply[0].startswith(b"HTTP/1.1 200 ")


def test_a_client_that_does_not_read_is_held_off_and_loses_no_reply(served: Served) -> None:
    """The server stops reading a connection whose replies pile up, so the client's sends block (without it, the
    server would read on and buffer replies without end); once the client reads, every request is answered, in
    order."""
    one = post(body=b"y" * 200)
    sent, pending = 0, one
    with socket.socket() as conn:
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            conn.setsockopt(socket.SOL_SOCKET, option, BUFFER_BYTES)
        conn.connect(("127.0.0.1", served.port))
        conn.setblocking(False)
        while sent < 20_000:  # ~5 MB of requests: far more than the sockets' and the transport's buffers
            if not select.select([], [conn], [], HELD_OFF_S)[1]:
                break  # not writable for that long: the server reads no more
            pending = pending[conn.send(pending) :]
            if not pending:
                sent, pending = sent + 1, one
        assert sent < 20_000, "the server read every request without its replies being read"
        rest = pending if len(pending) < len(one) else b""  # a request half written
        sent += bool(rest)
        conn.setblocking(True)
        finishing = threading.Thread(target=conn.sendall, args=(rest,))
        finishing.start()
        buffer = bytearray()
        counts = []
        for _ in range(sent):
            reply = read_reply(conn, buffer)
            assert reply is not None
            counts.append(json.loads(reply[1])["n"])
        finishing.join(10)
        assert counts == list(range(1, sent + 1))


def test_stopping_closes_the_connections(served: Served) -> None:
    conn = connect(served)
    conn.sendall(post())
    assert read_reply(conn, bytearray()) is not None
    served.loop.call_soon_threadsafe(served.stop.set)
    conn.settimeout(10)
    assert conn.recv(10) == b""
    conn.close()
