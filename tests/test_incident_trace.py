"""Every incident as one OpenTelemetry trace: a fatal XID on a node of a run (the in-memory backend, real clock),
its recovery, and the first productive step after it, exported by the real OTLP/HTTP exporter into a local receiver
that decodes the protobuf (tests/otlp.py). The agent's span of the XID (its real ``GpuHealth`` and tracer, the event
sent over the heartbeat's wire format) is the root span's link."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import sqlalchemy as sa

from opsd.backends.fake import FakeBackend
from opsd.controller.config import ControllerConfig
from opsd.controller.controller import Controller
from opsd.controller.metrics import ApiStats, ControllerCollector
from opsd.controller.port import ErrorKind, Failed
from opsd.controller.recovery import COMPLETED
from opsd.controller.rows import RunSpec
from opsd.controller.state import StateStore
from opsd.controller.tracing import ENDPOINT_VARIABLES, IncidentTracing
from opsd.controller.views import postmortem_bundle
from opsd.errors import BodyError
from opsd.policy.detection import DetectionConfig
from opsd.policy.xid import WatchWindow
from opsd.postmortem.build import build
from opsd.postmortem.render import to_markdown
from opsd.protocol.heartbeat import Heartbeat, HeartbeatEvent, HeartbeatRank, decode_heartbeat, encode
from opsd.protocol.states import IncidentState, NodeRole
from opsd.protocol.xid_table import load_xid_table
from opsd_agent.gpu import FileGpuSource
from opsd_agent.health import GpuHealth
from opsd_agent.tracing import Tracing
from tests.backend_contract import XID, SimulatedCrashError, crash_at
from tests.otlp import OtlpReceiver, ReceivedSpan
from tests.rows import stored

RUN = "job"
CONFIG = ControllerConfig(detection=DetectionConfig(heartbeat_floor_s=30, hang_floor_s=30), step_retry_max_s=0.1)
STEPS = ["quarantine", "promote_spare", "stop", "relaunch", "resume"]  # the fatal XID's recovery, in order
STEP_PAUSE_S = 0.05  # the fake backend is instant: each step takes this long, so that the spans have lengths


class SlowFakeBackend(FakeBackend):
    """The in-memory backend, each machine-level step taking ``STEP_PAUSE_S``."""

    def _once(self, step: str, request_id: str, args: dict[str, Any], carry_out: Any) -> Any:
        time.sleep(STEP_PAUSE_S)  # the step's own duration, which its span measures
        return super()._once(step, request_id, args, carry_out)


def beat(node: str, ranks: dict[int, int], events: list[HeartbeatEvent] | None = None, at_s: float = 0.0) -> Heartbeat:
    """A heartbeat from ``node`` (rank -> step) sent at ``at_s`` (now if 0), through the wire format as the API
    takes it."""
    now = at_s or time.time()
    listed = [HeartbeatRank(run=RUN, rank=r, step=s, step_s=0.1, last_report_unix_s=now) for r, s in ranks.items()]
    return decode_heartbeat(encode(Heartbeat(v=1, node=node, time_unix_s=now, ranks=listed, events=events or [])))


def xid_incident(tmp_path: Path, tracing: IncidentTracing, agent_tracing: Tracing) -> tuple[Controller, int]:
    """A run on node-0 and node-1 with a spare node-2; an XID 79 on node-1, seen by its agent's ``GpuHealth``, sent
    in a heartbeat; detected, recovered from, and the new launch's first step: the incident, recovered."""
    controller = running(tmp_path, tracing, SlowFakeBackend(["node-0", "node-1", "node-2"]))
    store = controller.store

    gpu = GpuHealth(FileGpuSource(tmp_path / "gpus"), load_xid_table(), WatchWindow(60, 1), tracer=agent_tracing.tracer)
    seen = gpu.record(0, 79, time.time())
    controller.heartbeat(beat("node-1", {1: 6}, [seen]), time.time())
    (_failure,) = controller.tick(time.time())  # detected: the recovery runs before the pass returns
    (incident,) = store.incidents(RUN)
    assert stored(store.run(RUN)).generation == 2, store.actions(run=RUN)
    first_step(controller)
    return controller, int(incident.id)


def running(tmp_path: Path, tracing: IncidentTracing, backend: FakeBackend) -> Controller:
    """A controller over a new store, a run on node-0 and node-1 with a spare node-2, its ranks at step 5."""
    store = StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}")
    controller = Controller(store, CONFIG, backend, tracing=tracing)
    controller.recovery.threaded = False
    now = time.time()
    store.create_run(RUN, RunSpec(backend="fake"), now)
    for i, node in enumerate(["node-0", "node-1", "node-2"]):
        store.upsert_node(node, now, run=RUN, role=NodeRole.ACTIVE if i < 2 else NodeRole.SPARE, domain="rack0")
    controller.recovery.launch_first(RUN, now)
    controller.heartbeat(beat("node-0", {0: 5}), time.time())
    controller.heartbeat(beat("node-1", {1: 5}), time.time())
    controller.tick(time.time())
    return controller


def first_step(controller: Controller) -> None:
    """The relaunched ranks (on node-0 and the spare) make their first step ``STEP_PAUSE_S`` after the relaunch (the
    time they take to start, given to the controller as its clock): the incident is recovered."""
    now = time.time() + STEP_PAUSE_S
    controller.heartbeat(beat("node-0", {0: 4}, at_s=now), now)  # resumed from a checkpoint: its first step
    controller.heartbeat(beat("node-2", {1: 4}, at_s=now), now)
    controller.tick(now)


def in_order(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
    return sorted(spans, key=lambda s: (s.start_ns, -s.end_ns))  # a span before those it contains


def test_an_xid_incident_is_one_trace_from_detection_to_the_first_productive_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with OtlpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
        agent_tracing = Tracing("node-1")
        controller, incident_id = xid_incident(tmp_path, IncidentTracing.from_environment(), agent_tracing)
        agent_tracing.shutdown()
        controller.tracing.shutdown()  # the controller stops: what is queued is exported
        received = receiver.spans()
    incident = controller.store.incident(incident_id)
    assert incident is not None
    assert incident.state == IncidentState.RECOVERED, incident

    (xid,) = [s for s in received if s.service == "opsd-agent"]
    spans = in_order([s for s in received if s.service == "opsd-controller"])
    assert {s.trace_id for s in spans} == {incident.trace_id}  # one trace, the one the store names
    root, *children = spans
    assert root.name == "incident"
    assert root.parent_span_id == ""
    assert [c.name for c in children] == STEPS
    assert all(c.parent_span_id == root.span_id for c in children)

    # the root: detection to the first productive step; linked to the agent's span of the XID
    assert incident.resumed_s is not None
    assert root.start_ns == int(incident.detected_s * 1e9)
    assert root.end_ns == int(incident.resumed_s * 1e9)
    assert root.links == ((xid.trace_id, xid.span_id, {"opsd.link": "caused_by"}),)
    assert (xid.name, xid.attributes["gpu.xid"]) == ("gpu.xid", 79)
    assert root.status_code == 1  # ok
    assert root.attributes["opsd.incident.kind"] == "fatal_xid"
    assert (root.attributes["opsd.run"], root.attributes["opsd.incident.id"]) == (RUN, incident_id)
    assert (root.attributes["opsd.node"], root.attributes["opsd.spare"]) == ("node-1", "node-2")

    # the steps: each within the root, one after the other, their durations adding up to the recovery time
    recovery_s = incident.resumed_s - incident.detected_s
    assert sum(c.duration_s for c in children) == pytest.approx(recovery_s, abs=1e-5)
    assert all(root.start_ns <= c.start_ns <= c.end_ns <= root.end_ns for c in children)
    assert all(a.end_ns == b.start_ns for a, b in itertools.pairwise(children))
    assert all(c.duration_s >= STEP_PAUSE_S * 0.9 for c in children), [(c.name, c.duration_s) for c in children]
    actions = controller.store.actions(incident_id=incident_id)
    for child, action in zip(children, actions, strict=False):  # the recorded steps, with their request ids
        assert child.attributes["opsd.request_id"] == action.request_id
        assert child.end_ns == int(action.done_s * 1e9)  # type: ignore[operator]
    for child in children:
        assert child.attributes["opsd.node"] == "node-1"
        assert child.attributes["opsd.result"]
    promote, relaunch = children[1], children[3]
    assert promote.attributes["opsd.spare"] == "node-2"
    assert '"spare": "node-2"' in promote.attributes["opsd.result"]
    assert relaunch.attributes["opsd.nodes"] == ["node-0", "node-2"]
    assert "opsd.request_id" not in children[-1].attributes  # resume is the ranks', no request of the controller

    # the post-mortem names the trace (Markdown, and the bundle's JSON)
    bundle = postmortem_bundle(controller, RUN, time.time())
    assert [i.trace_id for i in bundle.incidents or ()] == [root.trace_id]
    assert [i["trace_id"] for i in json.loads(msgspec.json.encode(bundle))["incidents"]] == [root.trace_id]
    assert f"- **trace id**: {root.trace_id}" in to_markdown(build(bundle, incident_id))
    assert controller.tracing.errors == {"build": 0, "export": 0}


def test_without_an_endpoint_nothing_is_traced_and_the_recovery_is_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for variable in ENDPOINT_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    tracing, agent_tracing = IncidentTracing.from_environment(), Tracing("node-1")
    assert (tracing.enabled, tracing.provider, agent_tracing.provider) == (False, None, None)
    controller, incident_id = xid_incident(tmp_path, tracing, agent_tracing)
    tracing.shutdown()
    incident = controller.store.incident(incident_id)
    assert incident is not None
    assert incident.state == IncidentState.RECOVERED
    assert (incident.trace_id, incident.gpu_trace_id, incident.gpu_span_id) == (None, None, None)
    assert "trace id" not in to_markdown(build(postmortem_bundle(controller, RUN, time.time()), incident_id))


def test_an_endpoint_that_refuses_is_counted_and_the_recovery_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with OtlpReceiver(status=400) as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
        agent_tracing = Tracing("node-1")
        controller, incident_id = xid_incident(tmp_path, IncidentTracing.from_environment(), agent_tracing)
        agent_tracing.shutdown()
        controller.tracing.shutdown()
        assert receiver.requests  # it was tried
    incident = controller.store.incident(incident_id)
    assert incident is not None
    assert incident.state == IncidentState.RECOVERED
    assert controller.tracing.errors["export"] >= 1
    exposed = {
        s.labels["stage"]: s.value
        for family in ControllerCollector(controller, ApiStats()).collect()
        if family.name == "opsd_controller_trace_errors"
        for s in family.samples
    }
    assert exposed["export"] >= 1
    assert exposed["build"] == 0


def test_a_recovery_that_fails_ends_its_trace_with_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The relaunch is refused for good: the run fails, and the trace ends there, the relaunch span in error."""
    with OtlpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
        store = StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}")
        backend = FakeBackend(["node-0", "node-1"])
        controller = Controller(store, CONFIG, backend, tracing=IncidentTracing.from_environment())
        controller.recovery.threaded = False
        now = time.time()
        store.create_run(RUN, RunSpec(backend="fake"), now)
        for node in ("node-0", "node-1"):
            store.upsert_node(node, now, run=RUN, role=NodeRole.ACTIVE)
        controller.recovery.launch_first(RUN, now)
        backend.fail_next["relaunch"] = [Failed(ErrorKind.PERMANENT, "no quota")]
        incident = controller.request_restart(RUN, "test", time.time())
        controller.tracing.shutdown()
        spans = in_order([s for s in receiver.spans() if s.service == "opsd-controller"])
    assert [s.name for s in spans] == ["incident", "checkpoint", "stop", "relaunch"]
    root, relaunch = spans[0], spans[-1]
    assert root.trace_id == stored(store.incident(incident.id)).trace_id
    assert (root.status_code, relaunch.status_code) == (2, 2)  # error
    assert "no quota" in root.attributes["opsd.result"]
    assert relaunch.end_ns == root.end_ns


def test_a_recovery_taken_up_by_another_controller_is_still_one_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The controller dies once the spare is promoted; its successor goes on with the recovery and exports the
    trace under the id the first one gave the incident."""
    with OtlpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
        backend = SlowFakeBackend(["node-0", "node-1", "node-2"])
        first = running(tmp_path, IncidentTracing.from_environment(), backend)
        first.recovery.on_step = crash_at(COMPLETED, 1)
        with pytest.raises(SimulatedCrashError):
            first.open_failure(stored(first.store.run(RUN)), [XID], time.time())
        (incident,) = first.store.incidents(RUN)
        successor = Controller(first.store, CONFIG, backend, tracing=IncidentTracing.from_environment())
        successor.recovery.threaded = False
        successor.recovery.take_up(stored(first.store.run(RUN)), time.time(), "the controller died (test)")
        first_step(successor)
        first.tracing.shutdown()  # nothing of its own to export: the incident had not ended
        successor.tracing.shutdown()
        spans = in_order(receiver.spans())
    assert {s.trace_id for s in spans} == {incident.trace_id}
    assert [s.name for s in spans] == ["incident", *STEPS]
    root, *children = spans
    assert all(root.start_ns <= c.start_ns <= c.end_ns <= root.end_ns for c in children)
    assert sum(c.duration_s for c in children) <= root.duration_s + 1e-5  # the controller's death: a gap


def test_a_store_of_an_earlier_version_gets_the_trace_columns(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'opsd.db'}"
    store = StateStore.open(url)
    store.open_incident(key="k", run="r", kind="hang", node="n", rank=0, detail="d", failed_s=1.0, detected_s=2.0)
    with store.engine.begin() as c:
        for column in ("trace_id", "gpu_trace_id", "gpu_span_id"):
            c.execute(sa.text(f"ALTER TABLE incidents DROP COLUMN {column}"))
    store.engine.dispose()
    again = StateStore.open(url)
    try:
        (incident,) = again.incidents()
        assert incident.trace_id is None
        again.update_incident(incident.id, trace_id="ab" * 16)
        assert stored(again.incident(incident.id)).trace_id == "ab" * 16
    finally:
        again.engine.dispose()


def test_a_heartbeat_event_carries_span_ids_in_hex_or_none() -> None:
    event = {"seq": 1, "gpu": 0, "xid": 79, "time_s": 1.0, "action": "cordon_and_swap"}
    body = {"v": 1, "node": "n", "time_unix_s": 1.0}
    (old,) = decode_heartbeat(json.dumps({**body, "events": [event]}).encode()).events  # an agent without spans
    assert (old.trace_id, old.span_id) == ("", "")
    traced = {**event, "trace_id": "0af7651916cd43dd8448eb211c80319c", "span_id": "b7ad6b7169203331"}
    (new,) = decode_heartbeat(json.dumps({**body, "events": [traced]}).encode()).events
    assert (new.trace_id, new.span_id) == (traced["trace_id"], traced["span_id"])
    for bad in ({"trace_id": "0AF7651916CD43DD8448EB211C80319C"}, {"span_id": "b7ad6b71"}, {"trace_id": "x" * 32}):
        with pytest.raises(BodyError, match=r"\$\.events\[0\]\.(trace|span)_id"):
            decode_heartbeat(json.dumps({**body, "events": [{**event, **bad}]}).encode())
