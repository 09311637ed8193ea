"""An agent that cannot reach its GPUs (no NVML in its container, as on a node whose container runtime ignores
NVIDIA_VISIBLE_DEVICES) keeps serving its ranks and heartbeating, and says why: in opsd_agent_gpu_source_up, in
/healthz and in its log; the source is tried again and taken up once it opens."""

from __future__ import annotations

import json
import logging
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from opsd.errors import PermanentError
from opsd.protocol.gpu_files import GpuSample
from opsd.protocol.wire import encode
from opsd_agent.daemon import Agent, AgentConfig
from opsd_agent.gpu_access import GpuAccess, GpuAccessCollector, reason_of
from tests.test_reporter import Controller
from tests.test_wire import report
from tests.waiting import wait_for


def nvml_loads() -> bool:
    import pynvml  # type: ignore[import-untyped]

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def gpu_up(text: str) -> list[tuple[dict[str, str], float]]:
    return [
        (s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "opsd_agent_gpu_source_up"
    ]


@pytest.fixture
def stand_in() -> Iterator[Controller]:
    """tests.test_reporter's stand-in controller, which records the heartbeats."""
    controller = Controller()
    controller.start()
    yield controller
    controller.stop()


def test_an_agent_without_nvml_keeps_serving_its_ranks_and_heartbeating_and_says_why(
    tmp_path: Path, stand_in: Controller, caplog: pytest.LogCaptureFixture
) -> None:
    """NVML for real: this machine has no NVIDIA driver, so nvidia-ml-py finds no libnvidia-ml.so.1, as in a
    container the runtime injected nothing into."""
    if nvml_loads():
        pytest.skip("NVML loads on this machine: the agent reads its GPUs")
    controller = stand_in
    caplog.set_level(logging.INFO, logger="agent")
    path = tmp_path / "a.sock"
    agent = Agent(
        AgentConfig(
            socket=str(path),
            metrics_port=0,
            node="gpu-node-3",
            gpu_source="nvml",
            controller_url=controller.url,
            controller_token=controller.token,
            heartbeat_interval_s=0.1,
        )
    )
    agent.start()  # no NVML: not an error that stops the agent
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as rank:
            rank.sendto(encode(report(rank=5, step=12)), str(path))
        wait_for("heartbeat with the rank's step", lambda: any(b["ranks"] for _, b in controller.requests), 10)
        base = f"http://127.0.0.1:{agent.metrics_port}"
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
            metrics = r.read().decode()
        with urllib.request.urlopen(f"{base}/healthz", timeout=5) as r:
            health = json.load(r)
    finally:
        agent.stop()
    body = next(b for _, b in controller.requests if b["ranks"])
    assert [(x["rank"], x["step"]) for x in body["ranks"]] == [(5, 12)]
    assert agent.stats.received == 1
    assert gpu_up(metrics) == [({"node": "gpu-node-3", "source": "nvml", "reason": "library_not_found"}, 0.0)]
    assert health["status"] == "ok"
    assert health["gpu"]["available"] is False
    assert health["gpu"]["reason"] == "library_not_found"
    assert "NVML Shared Library Not Found" in health["gpu"]["detail"]
    warnings = [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "opsd_agent.gpu_access"
    ]
    assert len(warnings) == 1  # said once, not at every retry
    assert "GPU source nvml unavailable (library_not_found" in warnings[0]
    assert "docs/kubernetes.md" in warnings[0]


class ScriptedNvml:
    """A GPU source whose opening fails as NVML does until ``opens`` is set, then samples ``gpus`` GPUs."""

    def __init__(self) -> None:
        self.error = "NVML is not available: Driver Not Loaded"
        self.opens = False
        self.gpus = 0
        self.tries = 0

    def __call__(self, spec: str) -> ScriptedNvml:
        self.tries += 1
        if not self.opens:
            raise PermanentError(self.error)
        return self

    def sample(self) -> list[GpuSample]:
        return [GpuSample(index=i, uuid=f"GPU-{i}") for i in range(self.gpus)]

    def xid_events(self, timeout_s: float) -> list[tuple[int, int]]:
        return []

    def close(self) -> None:
        pass


def test_a_source_that_cannot_be_opened_is_tried_again_and_taken_up() -> None:
    """Time is driven by hand: a failed open is tried again only after retry_s, at a sample; once it opens, a source
    that shows no GPU says so, then the GPUs are read."""
    nvml, now = ScriptedNvml(), [100.0]
    access = GpuAccess("nvml", retry_s=60.0, opener=nvml, clock=lambda: now[0])
    assert (access.status.available, access.status.reason, nvml.tries) == (False, "driver_not_loaded", 1)
    assert access.sample() == []
    now[0] += 59.0
    nvml.opens = True
    assert access.sample() == []
    assert nvml.tries == 1  # not yet
    now[0] += 1.0
    assert access.sample() == []  # opened, but NVML shows no GPU
    assert (nvml.tries, access.status.reason, access.status.available) == (2, "no_gpus", False)
    nvml.gpus = 8
    assert len(access.sample()) == 8
    assert (access.status.available, access.status.reason, access.status.gpus) == (True, "ok", 8)
    exposed = list(GpuAccessCollector(access, "n1").collect())
    labels = {"node": "n1", "source": "nvml", "reason": "ok"}
    assert [(s.labels, s.value) for s in exposed[0].samples] == [(labels, 1.0)]


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        pytest.param("NVML is not available: NVML Shared Library Not Found", "library_not_found", id="no-library"),
        pytest.param("NVML is not available: Function Not Found", "library_not_found", id="old-library"),
        pytest.param("NVML is not available: Driver Not Loaded", "driver_not_loaded", id="no-driver"),
        pytest.param("NVML is not available: Insufficient Permissions", "no_permission", id="devices-closed"),
        pytest.param("NVML is not available: Unknown Error", "error", id="other"),
    ],
)
def test_reasons(message: str, reason: str) -> None:
    assert reason_of(message) == reason


def test_a_node_without_gpus_by_configuration_is_not_a_fault() -> None:
    access = GpuAccess("none")
    assert access.sample() == []
    assert (access.status.source, access.status.available, access.status.reason) == ("none", True, "ok")
