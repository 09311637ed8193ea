"""``bench.controller_scale`` on a small load (32 nodes x 8 GPUs): the real ``opsd serve`` takes heartbeats and
liveness datagrams, finds the node that went silent, and the benchmark's figures are printed last, as
``name=value``."""

from __future__ import annotations

import asyncio
import math
import re
import time

import pytest

from bench.controller_scale import main
from bench.simulated_agents import Node, Plan, exchange


@pytest.mark.slow
def test_a_small_load_finds_the_silent_node(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--nodes", "32", "--gpus-per-node", "8", "--warmup-s", "2", "--duration-s", "7"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].startswith("ingest_p99_ms=")
    assert lines[-1].startswith("silent_node_detect_s=")
    figures = {k: float(v) for k, v in (line.split("=", 1) for line in lines if re.fullmatch(r"\w+=\S+", line))}
    assert "silent node node-00016: no heartbeat for" in "\n".join(lines)
    assert 3.0 < figures["silent_node_detect_s"] < 10.0  # 5 x the 1 s interval, a pass and a poll after
    assert 0 < figures["ingest_p99_ms"] < 1000.0
    assert 25 <= figures["heartbeats_per_s"] <= 32  # 31 nodes heartbeat, one a second each
    assert 25 <= figures["datagrams_per_s"] <= 32  # and say they are alive by datagram, once a second each
    assert 0 < figures["datagram_p99_ms"] <= figures["ingest_p99_ms"]
    assert math.isfinite(figures["controller_cpu_ratio"])
    assert 0 <= figures["load_lag_p99_ms"] < 1000.0


def test_a_reply_is_timed_when_its_last_bytes_are_read() -> None:
    async def scenario() -> None:
        pieces: asyncio.Queue[bytes] = asyncio.Queue()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            while (piece := await pieces.get()) != b"":
                writer.write(piece)
                await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        node = Node(0, Plan("127.0.0.1", port, 2, 1, time.time(), (0.0, 1.0), 1, 0.0))
        request = b"POST /v1/heartbeat HTTP/1.1\r\ncontent-length: 0\r\n\r\n"
        sent = asyncio.create_task(exchange(node, "127.0.0.1", port, request))
        await pieces.put(b"HTTP/1.1 200 OK\r\ncontent-le")
        await pieces.put(b'ngth: 7\r\n\r\n{"a":')
        await asyncio.sleep(0.2)
        assert not sent.done()  # the body is not all there yet
        before_s = time.perf_counter()
        await pieces.put(b"1}")
        head, body, read_s = await sent
        assert head.startswith(b"HTTP/1.1 200")
        assert body == b'{"a":1}'
        assert read_s >= before_s  # timed at the last piece, not at the first
        again = asyncio.create_task(exchange(node, "127.0.0.1", port, request))
        await pieces.put(b"")  # the controller closes the connection instead of answering
        with pytest.raises(ConnectionResetError):
            await again
        assert port not in node.connections  # the next request opens a new one
        server.close()

    asyncio.run(scenario())
