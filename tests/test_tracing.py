"""The agent's OpenTelemetry spans reach an OTLP/HTTP endpoint (a real HTTP server decoding the protobuf)."""

from __future__ import annotations

from pathlib import Path

import pytest

from opsd.protocol.gpu_files import inject_xid
from opsd_agent.daemon import Agent, AgentConfig
from tests.otlp import OtlpReceiver
from tests.test_gpu_health import start_file_agent, xids_seen
from tests.waiting import wait_for


def test_xid_events_become_spans_over_otlp_http(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with OtlpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
        agent, gpus = start_file_agent(tmp_path, node="n3")
        try:
            inject_xid(gpus, 1, 79)
            wait_for("injected XID at the agent", lambda: xids_seen(agent) >= 1, 10)
        finally:
            agent.stop()  # flushes the spans
        assert receiver.requests, "no OTLP request arrived"
        (span,) = receiver.spans()
        assert agent.gpu is not None
        (event,) = agent.gpu.pending_events()
    assert span.service == "opsd-agent"
    assert span.name == "gpu.xid"
    assert span.attributes["gpu.index"] == 1
    assert span.attributes["gpu.xid"] == 79
    assert span.attributes["opsd.action"] == "cordon_and_swap"
    # the event the controller is sent names its span: the incident's trace links to it
    assert (event.trace_id, event.span_id) == (span.trace_id, span.span_id)


def test_without_an_endpoint_spans_are_noops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(variable, raising=False)
    agent = Agent(AgentConfig(socket=str(tmp_path / "a.sock"), metrics_port=0, node="n"))
    agent.start()
    try:
        assert agent.tracing is not None
        assert agent.tracing.provider is None
    finally:
        agent.stop()
