"""Flight Recorder dumps sent to a real ``opsd agent`` process: streamed to disk, a bounded number at a time, so that
many ranks sending their largest dumps at once cost the agent a few MiB, not the dumps' size (the chart gives it
1 GiB; a dump parsed whole cost ~5 times its size)."""

from __future__ import annotations

import io
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from opsd.backends.local.processes import free_port
from opsd.protocol.node_agent import FLIGHT_PATH, MAX_DUMP_BYTES, UPLOAD_SLOTS
from opsd_agent.endpoints import DumpIntake
from tests.launch import agent_until_sigterm

MiB = 1 << 20


def largest_dump(rank: int) -> bytes:
    """A dump of many small trace entries (what makes a parsed dump large), just under the agent's limit."""
    entry = {"record_id": 0, "profiling_name": "gloo:all_reduce", "input_sizes": [[4096]], "state": "scheduled"}
    size = len(json.dumps(entry)) + 2 + 7  # ", " and a record id of up to 7 digits
    entries = [dict(entry, record_id=i) for i in range((MAX_DUMP_BYTES - 4096) // size)]
    body = json.dumps({"v": 1, "run": "big", "trigger": "cmd-1", "rank": rank, "trace": {"entries": entries}})
    return body.encode()


def anonymous_rss_bytes(pid: int) -> int:
    """The process's resident anonymous memory: what no reclaim can take back (the pages of the files it maps or
    writes are page cache, which the kernel reclaims under the cgroup's limit)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/PID/status")


def agent_pid(port: int) -> int:
    """The pid of the process listening on ``port`` (the agent; ``agent_until_sigterm`` keeps its Popen)."""
    inode = ""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1].endswith(f":{port:04X}") and fields[3] == "0A":  # LISTEN
            inode = fields[9]
    assert inode, f"nothing listens on {port}"
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            if fd.readlink() == Path(f"socket:[{inode}]"):
                return int(fd.parts[2])
        except OSError:
            continue
    raise AssertionError(f"no process holds the socket listening on {port}")


@pytest.mark.slow
def test_eight_ranks_sending_their_largest_dumps_at_once_cost_the_agent_little_memory(tmp_path: Path) -> None:
    port = free_port()
    spool = tmp_path / "spool"
    senders = 8
    body = largest_dump(0)
    assert 0 <= MAX_DUMP_BYTES - len(body) < 8 * MiB
    answers: dict[int, int] = {}
    measured: dict[str, int] = {}

    def send(rank: int) -> None:
        data = body.replace(b'"rank": 0', f'"rank": {rank}'.encode(), 1)
        request = urllib.request.Request(f"http://127.0.0.1:{port}{FLIGHT_PATH}", data=data, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=120) as answer:
                answers[rank] = answer.status
        except urllib.error.HTTPError as exc:
            answers[rank] = exc.code

    def while_running() -> None:
        pid = agent_pid(port)
        measured["before"] = measured["peak"] = anonymous_rss_bytes(pid)
        threads = [threading.Thread(target=send, args=(rank,)) for rank in range(senders)]
        for thread in threads:
            thread.start()
        while any(thread.is_alive() for thread in threads):
            measured["peak"] = max(measured["peak"], anonymous_rss_bytes(pid))
            time.sleep(0.005)

    args = ["--socket", str(tmp_path / "agent.sock"), "--metrics-port", str(port), "--gpu-source", "none"]
    _, ended = agent_until_sigterm([*args, "--flight-dir", str(spool), "--node", "n0"], port, while_running)
    assert ended.returncode == 0, ended.stderr[-2000:]
    assert answers == dict.fromkeys(range(senders), 201)
    for rank in range(senders):
        stored = spool / "big" / "cmd-1" / f"rank-{rank}.json"
        assert stored.stat().st_size == len(body)
    assert not list(spool.rglob("*.tmp"))
    grown = measured["peak"] - measured["before"]
    # 8 dumps of 64 MiB: held whole they are 512 MiB, parsed ~2.5 GiB; streamed, a chunk per upload slot
    assert grown < 32 * MiB, f"the agent's peak memory grew {grown / MiB:.0f} MiB for {senders} uploads"


def test_a_sender_past_the_upload_slots_waits_then_is_told_to_send_again(tmp_path: Path) -> None:
    intake = DumpIntake(str(tmp_path), slots=1, wait_s=0.05)
    release = threading.Event()

    class Stalling(io.BytesIO):
        def read(self, size: int | None = -1) -> bytes:
            release.wait(10)
            return super().read(size)

    dump = json.dumps({"run": "r", "trigger": "t", "rank": 1}).encode()
    first: list[tuple[int, object]] = []
    holder = threading.Thread(target=lambda: first.append(intake.take_stream(Stalling(dump), len(dump))))
    holder.start()
    try:
        status, answer = intake.take(dump.replace(b'"rank": 1', b'"rank": 2'))
    finally:
        release.set()
        holder.join(10)
    assert (status, answer["retry_after_s"]) == (503, 1)
    assert first == [(201, {"stored": "r/t/rank-1.json"})]
    assert intake.take(dump.replace(b'"rank": 1', b'"rank": 2'))[0] == 201  # the slot is free again
    assert intake.counts == {"ok": 2, "rejected": 0, "too_large": 0, "busy": 1}


@pytest.mark.parametrize(
    ("body", "missing_bytes", "why"),
    [
        pytest.param(b"", 0, "empty", id="empty"),
        pytest.param(b'{"run": "r", "trigger": "t", "rank": 1', 0, "truncated", id="truncated JSON"),
        pytest.param(b'{"run": "r", "trigger": "t", "rank": 1}', 20, "short", id="body shorter than its length"),
        pytest.param(b'{"run": "r", "trigger": "t", "rank": true}', 0, "bool", id="rank not an integer"),
        pytest.param(b'{"run": "", "trigger": "t", "rank": 1}', 0, "length >= 1", id="empty run"),
        pytest.param(b"[1, 2]", 0, "object", id="not an object"),
    ],
)
def test_a_body_that_is_not_a_dump_is_rejected_and_leaves_no_file(
    tmp_path: Path, body: bytes, missing_bytes: int, why: str
) -> None:
    intake = DumpIntake(str(tmp_path))
    status, answer = intake.take_stream(io.BytesIO(body), len(body) + missing_bytes)
    assert status == 400
    assert why in str(answer["detail"])
    assert intake.counts["rejected"] == 1
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_slots_are_at_least_one() -> None:
    with pytest.raises(ValueError, match="at least one"):
        DumpIntake(None, slots=0)
    assert UPLOAD_SLOTS >= 1


@pytest.mark.parametrize(
    ("answers", "sent", "errors"),
    [
        pytest.param([503, 503, 201], 3, 0, id="busy twice, then taken"),
        pytest.param([503] * 5, 5, 1, id="busy every time: given up after 5 attempts"),
        pytest.param([400], 1, 1, id="refused: not sent again"),
    ],
)
def test_a_rank_sends_its_dump_again_while_the_agent_is_busy(
    answers: list[int], sent: int, errors: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from trainer_hooks.flight import FlightRecorder

    queue = list(answers)
    bodies: list[bytes] = []

    class Agent(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
            status = queue.pop(0) if queue else 500
            self.send_response(status)
            if status == 503:
                self.send_header("Retry-After", "0")
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, format: str, *args: object) -> None:
            pass

    for name in ("OPSD_FLIGHT_DIR", "OPSD_AGENT_HOST", "OPSD_POLICY_FILE"):
        monkeypatch.delenv(name, raising=False)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Agent)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        recorder = FlightRecorder("r", 0, 1)
        recorder.upload_url = f"http://127.0.0.1:{server.server_address[1]}{FLIGHT_PATH}"
        recorder.dump("cmd-1")
    finally:
        server.shutdown()
        server.server_close()
    assert (len(bodies), recorder.errors, recorder.dumps) == (sent, errors, 1 - errors)
    assert len(set(bodies)) == 1  # the same dump each time
