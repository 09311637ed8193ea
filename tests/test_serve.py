"""`opsd serve` and `opsd agent` as real processes: heartbeats over HTTP with the token, an XID injected into
the agent's (fake) GPU source becomes an incident on the controller, acknowledged back to the agent."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from opsd.backends.local.processes import free_port
from opsd.protocol.gpu_files import GpuSample, inject_xid, write_samples
from opsd.protocol.wire import encode
from tests.test_wire import report
from tests.waiting import get_json, wait_for

pytestmark = pytest.mark.slow

TOKEN = "integration-token"
HTTP: dict[str, Any] = {"retry_on": (OSError,), "interval_s": 0.2}  # a refused connection or an HTTP error: not yet


def get(url: str) -> Any:
    return get_json(url, token=TOKEN, timeout_s=5)  # reads want the token


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[dict[str, Any]]:
    port = free_port()
    gpus = tmp_path / "gpus"
    gpus.mkdir()
    write_samples(gpus, [GpuSample(0, "GPU-0"), GpuSample(1, "GPU-1")])
    opsd = [sys.executable, "-m", "opsd"]
    serve = subprocess.Popen(
        [*opsd, "serve", "--port", str(port), "--state-dir", str(tmp_path / "state"), "--token", TOKEN],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    sock = str(tmp_path / "agent.sock")
    agent = subprocess.Popen(
        [
            *opsd,
            "agent",
            "--socket",
            sock,
            "--metrics-port",
            "0",
            "--node",
            "node-a",
            "--gpu-source",
            f"file:{gpus}",
            "--gpu-interval-s",
            "0.2",
            "--controller-url",
            f"{url}/v1/heartbeat",
            "--controller-token",
            TOKEN,
            "--heartbeat-interval-s",
            "0.3",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def running() -> bool:
        return serve.poll() is None and agent.poll() is None

    try:
        wait_for("healthy controller", lambda: get(f"{url}/healthz")["status"] == "ok", 20, alive=running, **HTTP)
        yield {"url": url, "socket": sock, "gpus": gpus, "agent": agent, "running": running}
    finally:
        for p in (agent, serve):
            p.terminate()
            p.wait(timeout=10)


def test_an_xid_on_a_node_becomes_an_incident(stack: dict[str, Any]) -> None:
    url, running = stack["url"], stack["running"]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        wait_for("socket of the agent", Path(stack["socket"]).exists, 20, alive=running)
        for step in (1, 2, 3):
            s.sendto(encode(report(run="demo", rank=0, step=step)), stack["socket"])
            s.sendto(encode(report(run="demo", rank=1, step=step)), stack["socket"])
    status = wait_for(
        "run demo", lambda: get(f"{url}/v1/runs") and get(f"{url}/v1/runs/demo"), 20, alive=running, **HTTP
    )
    assert status["ranks"] == 2
    injected = time.monotonic()
    inject_xid(stack["gpus"], gpu=1, xid=79)
    (incident,) = wait_for("incident", lambda: get(f"{url}/v1/runs/demo/incidents"), 20, alive=running, **HTTP)
    detected_after_s = time.monotonic() - injected
    assert (incident["kind"], incident["node"]) == ("fatal_xid", "node-a")
    assert "XID 79 on GPU 1" in incident["detail"]
    assert detected_after_s < 5.0
    # acknowledged: the agent stops resending it (its pending count drops to 0)
    scrape = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(scrape, timeout=5) as r:
        metrics = r.read().decode()
    assert 'opsd_run_incidents_total{cause="fatal_xid",run="demo"} 1.0' in metrics
    nodes = get(f"{url}/v1/nodes")
    assert wait_for(
        "acknowledgement of the XID", lambda: get(f"{url}/v1/nodes")[0]["events_acked"] >= 1, 20, alive=running, **HTTP
    )
    assert nodes[0]["name"] == "node-a"
    cli = [sys.executable, "-m", "opsd"]
    auth = ["--url", url, "--token", TOKEN]
    out = subprocess.run([*cli, "incidents", "demo", "--json", *auth], capture_output=True, text=True, check=True)
    assert [i["kind"] for i in json.loads(out.stdout)] == ["fatal_xid"]
    out = subprocess.run([*cli, "status", "demo", "--json", *auth], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["open_incidents"] == 1
    wide = {**os.environ, "COLUMNS": "200"}  # rich's width when not on a terminal
    table = subprocess.run(
        [*cli, "incidents", "demo", *auth], capture_output=True, text=True, check=True, env=wide
    ).stdout
    assert "fatal_xid" in table
    assert "XID 79 on GPU 1" in table
    assert "node-a" not in table  # the node is a secondary column: --wide adds it
    table = subprocess.run(
        [*cli, "incidents", "demo", "--wide", *auth], capture_output=True, text=True, check=True, env=wide
    ).stdout
    assert "node-a" in table
    missing = subprocess.run([*cli, "status", "nope", *auth], capture_output=True, text=True)
    assert missing.returncode == 1
    assert "404 no run 'nope'" in missing.stderr
