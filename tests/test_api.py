"""The controller's HTTP API: tokens, validation with a message and a counter, no 5xx on any body (hypothesis),
the OpenAPI document, run-level metrics."""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import msgspec
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from opsd.api.app import create_app
from opsd.api.auth import Credentials
from opsd.controller.config import ControllerConfig
from opsd.controller.controller import Controller
from opsd.controller.state import StateStore
from opsd.errors import PermanentError
from opsd.policy.cadence import Cadence
from opsd.policy.stragglers import StragglerScore
from opsd.protocol.answers import CadenceView, Checkpoints, RunStatus, SparePools, decode_answer
from tests.spares import implied_pool

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NOBODY = {"Authorization": ""}  # a request without a token (the clients below send the operator's by default)


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory) -> Controller:
    return Controller(StateStore.open(f"sqlite:///{tmp_path_factory.mktemp('api') / 'opsd.db'}"))


@pytest.fixture(scope="module")
def client(controller: Controller) -> Iterator[TestClient]:
    with TestClient(create_app(controller, TOKEN), headers=AUTH) as c:
        yield c


def heartbeat(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "v": 1,
        "node": "n0",
        "time_unix_s": 1.0,
        "ranks": [{"run": "job", "rank": 0, "step": 3, "step_s": 0.5, "compute_s": 0.4, "coords": {"dp_shard": 0}}],
        "events": [],
    }
    body.update(changes)
    return body


def rejected(client: TestClient, reason: str) -> float:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "opsd_controller_rejected_requests_total" and sample.labels["reason"] == reason:
                return sample.value
    raise AssertionError("no rejection counter")


def test_a_heartbeat_with_the_token_is_taken(client: TestClient) -> None:
    reply = client.post("/v1/heartbeat", json=heartbeat(), headers=AUTH)
    assert reply.status_code == 200, reply.text
    assert reply.json()["ack_events_up_to"] == 0
    assert [r["id"] for r in client.get("/v1/runs").json()] == ["job"]
    status = client.get("/v1/runs/job").json()
    assert (status["step"], status["ranks"]) == (3, 1)


@pytest.mark.parametrize(
    "headers", [NOBODY, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}], ids=["none", "wrong", "no-bearer"]
)
def test_mutating_endpoints_refuse_requests_without_the_token(client: TestClient, headers: dict[str, str]) -> None:
    before = rejected(client, "auth")
    assert client.post("/v1/heartbeat", json=heartbeat(), headers=headers).status_code == 401
    assert client.post("/v1/nodes/n0/cordon", json={"reason": "x"}, headers=headers).status_code == 401
    assert client.post("/v1/nodes/n0/uncordon", headers=headers).status_code == 401
    assert rejected(client, "auth") == before + 3


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (heartbeat(v=2), "v"),
        (heartbeat(node=""), "node"),
        (heartbeat(node="../etc"), "node"),
        (heartbeat(ranks=[{"run": "job", "rank": -1, "step": 1, "step_s": 1}]), "rank"),
        (heartbeat(ranks=[{"run": "job", "rank": 0, "step": 1, "step_s": "fast"}]), "step_s"),
        ({"v": 1}, "node"),
    ],
    ids=["version", "empty-node", "bad-node", "negative-rank", "string-seconds", "missing"],
)
def test_bad_bodies_get_a_422_naming_the_field(client: TestClient, body: dict[str, Any], field: str) -> None:
    before = rejected(client, "validation")
    reply = client.post("/v1/heartbeat", json=body, headers=AUTH)
    assert reply.status_code == 422
    assert field in reply.json()["detail"]
    assert rejected(client, "validation") == before + 1


def test_not_json_and_nan_are_refused(client: TestClient) -> None:
    assert (
        client.post("/v1/heartbeat", content=b"{nope", headers={**AUTH, "Content-Type": "application/json"}).status_code
        == 422
    )
    nan = json.dumps(heartbeat(time_unix_s=float("nan")))
    assert (
        client.post("/v1/heartbeat", content=nan, headers={**AUTH, "Content-Type": "application/json"}).status_code
        == 422
    )


def test_cordon_and_uncordon(client: TestClient) -> None:
    client.post("/v1/heartbeat", json=heartbeat(), headers=AUTH)
    assert client.post("/v1/nodes/ghost/cordon", json={"reason": "x"}, headers=AUTH).status_code == 404
    node = client.post("/v1/nodes/n0/cordon", json={"reason": "bad DIMM"}, headers=AUTH).json()
    assert (node["role"], node["reason"]) == ("cordoned", "bad DIMM")
    assert client.post("/v1/nodes/n0/uncordon", headers=AUTH).json()["role"] == "spare"


def test_unknown_runs_are_404(client: TestClient) -> None:
    for path in ("/v1/runs/nope", "/v1/runs/nope/incidents", "/v1/runs/nope/actions"):
        assert client.get(path).status_code == 404


def test_openapi_lists_the_endpoints(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    assert {
        "/v1/heartbeat",
        "/v1/runs",
        "/v1/runs/{run}",
        "/v1/runs/{run}/incidents",
        "/v1/nodes/{node}/cordon",
    } <= set(spec["paths"])


def test_run_metrics_are_exposed(client: TestClient) -> None:
    client.post("/v1/heartbeat", json=heartbeat(), headers=AUTH)
    names = {f.name for f in text_string_to_metric_families(client.get("/metrics").text)}
    assert {"opsd_run_mfu_ratio", "opsd_run_step", "opsd_run_ettr_ratio", "opsd_run_spares_available"} <= names


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)
FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "v": JSON,
        "node": JSON,
        "time_unix_s": JSON,
        "ranks": st.lists(
            st.dictionaries(st.sampled_from(["run", "rank", "step", "step_s", "coords"]), JSON), max_size=3
        ),
        "events": st.lists(
            st.dictionaries(st.sampled_from(["seq", "gpu", "xid", "action", "time_s"]), JSON), max_size=3
        ),
    },
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=FIELDS | JSON)
def test_no_body_makes_the_controller_fail(client: TestClient, body: Any) -> None:
    reply = client.post("/v1/heartbeat", json=body, headers=AUTH)
    assert reply.status_code in (200, 422), reply.text
    if reply.status_code == 422:
        assert reply.json()["detail"]


def test_every_controller_metric_is_documented_with_its_type(client: TestClient, controller: Controller) -> None:
    text = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text().split("\n# Controller\n")[1]
    documented = dict(re.findall(r"^\| `(opsd_\w+)` \| (gauge|counter|histogram) \|", text, flags=re.M))
    client.post("/v1/heartbeat", json=heartbeat(), headers=AUTH)
    controller.remember("job").cadence = Cadence(10, 20, 100.0, 3600.0, "test")  # so that the cadence series exist
    saved = heartbeat(ranks=[{**heartbeat()["ranks"][0], "checkpoints": 1, "checkpoint_blocking_s": 0.5}])
    client.post("/v1/heartbeat", json=saved, headers=AUTH)  # and those of checkpoints
    controller.remember("job").stragglers = [StragglerScore(0, "n0", 0, 1.3, 30, True)]  # and of a flagged rank
    controller.store.open_incident(
        key="doc", run="job", kind="hang", node="n0", rank=0, detail="d", failed_s=0.0, detected_s=0.0
    )
    controller.store.upsert_node("spare-0", 0.0, role="spare")  # a node of no run: the shared pool's series
    exposed = {
        f.name + ("_total" if f.type == "counter" else ""): f.type
        for f in text_string_to_metric_families(client.get("/metrics").text)
    }
    assert exposed == documented


def metric_samples(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(client.get("/metrics").text)
        for s in f.samples
    }


def test_the_pipeline_bubble_of_a_run_is_set_beside_its_theory(client: TestClient) -> None:
    def rank(n: int, stage: int, ratio: float, microbatches: int = 8) -> dict[str, Any]:
        pipeline = {"bubble_ratio": ratio, "schedule": "1f1b", "stages": 2, "microbatches": microbatches}
        return {"run": "job", "rank": n, "step": 3, "step_s": 0.5, "coords": {"pp": stage}, "pipeline": pipeline}

    client.post("/v1/heartbeat", json=heartbeat(ranks=[rank(0, 0, 0.30), rank(1, 1, 0.20)]), headers=AUTH)
    run = (("run", "job"),)
    metrics = metric_samples(client)
    assert metrics[("opsd_run_pipeline_bubble_ratio", run)] == pytest.approx(0.25)
    assert metrics[("opsd_pipeline_bubble_theoretical_ratio", run)] == pytest.approx(1 / 9)  # (2 - 1) / (8 + 2 - 1)
    assert metrics[("opsd_pipeline_bubble_margin_ratio", run)] == pytest.approx(0.10)
    status = client.get("/v1/runs/job", headers=AUTH).json()["pipeline"]
    assert status["stage_ratios"] == {"0": pytest.approx(0.30), "1": pytest.approx(0.20)}
    assert status["over_theory"] is True  # 0.25 is more than 0.10 above 0.111
    assert (status["schedule"], status["stages"], status["microbatches"]) == ("1f1b", 2, 8)
    # ranks that disagree on their schedule give no theory; the measured bubble stays
    client.post("/v1/heartbeat", json=heartbeat(ranks=[rank(0, 0, 0.30), rank(1, 1, 0.20, 4)]), headers=AUTH)
    metrics = metric_samples(client)
    assert ("opsd_pipeline_bubble_theoretical_ratio", run) not in metrics
    assert metrics[("opsd_run_pipeline_bubble_ratio", run)] == pytest.approx(0.25)
    assert client.get("/v1/runs/job", headers=AUTH).json()["pipeline"]["over_theory"] is False


def test_an_unreachable_state_store_answers_503_with_retry_after(tmp_path: Path) -> None:
    directory = tmp_path / "state"
    directory.mkdir()
    store = StateStore.open(f"sqlite:///{directory / 'opsd.db'}")
    with TestClient(create_app(Controller(store), TOKEN), headers=AUTH) as c:
        shutil.rmtree(directory)
        store.engine.dispose()  # no pooled connection to the old file: the next one must open it
        reply = c.get("/v1/runs")
    assert reply.status_code == 503
    assert reply.headers["Retry-After"] == "1"
    assert "state store" in reply.json()["detail"]


def test_fault_injection_needs_the_local_backend(client: TestClient) -> None:
    client.post("/v1/heartbeat", json=heartbeat(), headers=AUTH)
    reply = client.post("/v1/runs/job/inject", json={"fault": "kill", "rank": 0}, headers=AUTH)
    assert reply.status_code == 409
    assert client.post("/v1/runs/job/inject", json={"fault": "melt"}, headers=AUTH).status_code == 422
    assert client.post("/v1/runs/job/inject", json={"fault": "kill"}, headers=NOBODY).status_code == 401


def samples(client: TestClient, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(client.get("/metrics").text)
        for sample in family.samples
        if sample.name == name
    }


def test_a_checkpoint_counts_once_every_rank_has_finished_it(tmp_path: Path) -> None:
    controller = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"))
    with TestClient(create_app(controller, TOKEN, clock=lambda: 1000.0), headers=AUTH) as c:
        ranks = [
            {"run": "job", "rank": r, "step": 3, "step_s": 0.5, "compute_s": 0.4, "checkpoints": 0} for r in (0, 1)
        ]
        c.post("/v1/heartbeat", json=heartbeat(ranks=ranks), headers=AUTH)
        ranks[0] = {**ranks[0], "checkpoints": 1, "checkpoint_blocking_s": 0.2}
        c.post("/v1/heartbeat", json=heartbeat(ranks=ranks), headers=AUTH)
        assert samples(c, "opsd_run_checkpoint_last_commit_timestamp_seconds") == {}  # rank 1 has not finished
        ranks[1] = {**ranks[1], "checkpoints": 1, "checkpoint_blocking_s": 0.4}
        c.post("/v1/heartbeat", json=heartbeat(ranks=ranks), headers=AUTH)
        (committed,) = samples(c, "opsd_run_checkpoint_last_commit_timestamp_seconds").values()
        assert committed > 0
        assert samples(c, "opsd_run_checkpoint_cost_seconds") == {(("run", "job"),): pytest.approx(0.3)}
        states = samples(c, "opsd_run_state")
        assert states[(("run", "job"), ("state", "running"))] == 1.0
        assert sum(states.values()) == 1.0
        assert samples(c, "opsd_run_spares_recommended") == {(("run", "job"),): 0.0}


def test_recovery_times_are_a_histogram(tmp_path: Path) -> None:
    controller = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"))
    with TestClient(create_app(controller, TOKEN), headers=AUTH) as c:
        c.post("/v1/heartbeat", json=heartbeat(), headers=AUTH)
        for n, took_s in enumerate((5.0, 45.0, 45.0, 4000.0)):
            i, _ = controller.store.open_incident(
                key=f"r{n}", run="job", kind="hang", node="n0", rank=0, detail="d", failed_s=0.0, detected_s=10.0
            )
            controller.store.update_incident(i, state="recovered", resumed_s=10.0 + took_s)
        buckets = {dict(k)["le"]: v for k, v in samples(c, "opsd_run_recovery_seconds_bucket").items()}
        assert (buckets["10.0"], buckets["30.0"], buckets["60.0"], buckets["3600.0"], buckets["+Inf"]) == (
            1,
            1,
            3,
            3,
            4,
        )
        assert samples(c, "opsd_run_recovery_seconds_sum") == {(("run", "job"),): 4095.0}


def histogram_median(buckets: dict[float, float]) -> float:
    """Prometheus's ``histogram_quantile(0.5, ...)``: linear within the bucket that holds the median."""
    total, lower, below = buckets[math.inf], 0.0, 0.0
    for le, count in sorted(buckets.items()):
        if count >= total / 2:
            return lower + (le - lower) * (total / 2 - below) / (count - below)
        lower, below = le, count
    raise AssertionError("no bucket holds the median")


@pytest.mark.parametrize("took_s", [3.0, 9.0, 12.0, 25.0, 50.0])
def test_the_dashboards_median_of_a_recovery_is_near_its_time(tmp_path: Path, took_s: float) -> None:
    """One recovery of ``took_s``: the recovery-time panel's p50 (interpolated in its bucket) within 25% of it."""
    controller = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"))
    with TestClient(create_app(controller, TOKEN), headers=AUTH) as c:
        c.post("/v1/heartbeat", json=heartbeat(), headers=AUTH)
        i, _ = controller.store.open_incident(
            key="r", run="job", kind="hang", node="n0", rank=0, detail="d", failed_s=0.0, detected_s=10.0
        )
        controller.store.update_incident(i, state="recovered", resumed_s=10.0 + took_s)
        buckets = {float(dict(k)["le"]): v for k, v in samples(c, "opsd_run_recovery_seconds_bucket").items()}
    assert histogram_median(buckets) == pytest.approx(took_s, rel=0.25)


def test_the_read_views_answer_for_a_run_and_404_for_others(client: TestClient) -> None:
    client.post("/v1/heartbeat", json=heartbeat(), headers=AUTH)
    for path in ("/v1/runs/nope/checkpoints", "/v1/runs/nope/cadence", "/v1/runs/nope/postmortem"):
        assert client.get(path).status_code == 404, path
    assert client.get("/v1/runs/job/checkpoints").json()["why"] == "the run has no checkpoint store"
    cadence = client.get("/v1/runs/job/cadence").json()
    assert cadence["node_mtbf_h"] > 0
    bundle = client.get("/v1/runs/job/postmortem").json()
    assert {"run", "status", "incidents", "actions", "checkpoints", "flight_recorder", "xid_table"} <= set(bundle)
    (pool,) = [r for r in client.get("/v1/spares").json()["runs"] if r["run"] == "job"]
    config = ControllerConfig()  # the controller's spare window and risk
    implied = implied_pool(pool["active_nodes"], cadence["node_mtbf_h"], config.spare_window_h, config.spare_risk)
    assert pool["recommended"] == implied


def test_restart_needs_the_token_a_reason_and_a_backend(client: TestClient) -> None:
    client.post("/v1/heartbeat", json=heartbeat(), headers=AUTH)
    assert client.post("/v1/runs/job/restart", json={"reason": "x"}, headers=NOBODY).status_code == 401
    assert client.post("/v1/runs/job/restart", json={}, headers=AUTH).status_code == 422
    assert client.post("/v1/runs/nope/restart", json={"reason": "x"}, headers=AUTH).status_code == 404
    refused = client.post("/v1/runs/job/restart", json={"reason": "x"}, headers=AUTH)
    assert refused.status_code == 409
    assert "no backend" in refused.json()["detail"]


# -- credentials by role (opsd.api.auth) ------------------------------------------------------------------------------
ROLE_TOKENS = {"operator": "op-token", "reader": "reader-token", "agent": "agent-token", "metrics": "metrics-token"}
PREVIOUS_TOKENS = {role: f"{token}-before-rotation" for role, token in ROLE_TOKENS.items()}
ENDPOINTS = {  # endpoint class -> (method, path, body)
    "runs": ("GET", "/v1/runs", None),
    "run": ("GET", "/v1/runs/job", None),
    "incidents": ("GET", "/v1/incidents", None),
    "postmortem": ("GET", "/v1/runs/job/postmortem", None),
    "checkpoints": ("GET", "/v1/runs/job/checkpoints", None),
    "flight-dumps": ("GET", "/v1/runs/job/flight-recorder", None),
    "openapi": ("GET", "/openapi.json", None),
    "metrics": ("GET", "/metrics", None),
    "heartbeat": ("POST", "/v1/heartbeat", heartbeat()),
    "flight-upload": ("POST", "/v1/runs/job/flight-recorder", {"run": "job"}),  # past the token: 422
    "cordon": ("POST", "/v1/nodes/n0/cordon", {"reason": "x"}),
    "restart": ("POST", "/v1/runs/job/restart", {"reason": "x"}),
    "healthz": ("GET", "/healthz", None),
}
READS = {"runs", "run", "incidents", "postmortem", "checkpoints", "flight-dumps", "openapi", "metrics"}
MAY = {
    "operator": set(ENDPOINTS),
    "reader": READS | {"healthz"},
    "agent": {"heartbeat", "flight-upload", "healthz"},
    "metrics": {"metrics", "healthz"},
    None: {"healthz"},
}


@pytest.fixture(scope="module")
def roles(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    controller = Controller(StateStore.open(f"sqlite:///{tmp_path_factory.mktemp('roles') / 'opsd.db'}"))
    credentials = Credentials(**ROLE_TOKENS, **{f"{role}_previous": token for role, token in PREVIOUS_TOKENS.items()})
    with TestClient(create_app(controller, credentials)) as c:
        c.post("/v1/heartbeat", json=heartbeat(), headers={"Authorization": "Bearer agent-token"})
        yield c


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
@pytest.mark.parametrize("role", [None, *ROLE_TOKENS], ids=str)
@pytest.mark.parametrize("tokens", [ROLE_TOKENS, PREVIOUS_TOKENS], ids=["current", "previous"])
def test_each_role_may_call_what_its_role_takes_and_no_more(
    roles: TestClient, role: str | None, endpoint: str, tokens: dict[str, str]
) -> None:
    """Every endpoint but /healthz wants a token: no token is 401, a known token whose role may not is 403. A role's
    previous token (kept by a rotation) may what its current one may, and no more."""
    method, path, body = ENDPOINTS[endpoint]
    headers = {"Authorization": f"Bearer {tokens[role]}"} if role else {}
    status = roles.request(method, path, json=body, headers=headers).status_code
    if endpoint in MAY[role]:
        assert status not in (401, 403), (role, endpoint, status)
    else:
        assert status == (401 if role is None else 403), (role, endpoint, status)


def test_refusals_are_counted_by_kind_and_tokens_are_distinct(roles: TestClient) -> None:
    scrape = {"Authorization": "Bearer metrics-token"}
    before = samples_with(roles, scrape)
    roles.get("/v1/runs", headers=scrape)  # a known token, not a reader's: forbidden
    roles.get("/v1/runs", headers={"Authorization": "Bearer nobody-knows-it"})  # unknown: auth
    after = samples_with(roles, scrape)
    assert after["forbidden"] == before.get("forbidden", 0) + 1
    assert after["auth"] == before.get("auth", 0) + 1
    with pytest.raises(ValueError, match="two roles share one"):
        Credentials(operator="same", reader="same")
    with pytest.raises(ValueError, match="two roles share one"):
        Credentials(operator="op", reader="r", agent_previous="r")  # an agent's old token is no reader's
    assert len(Credentials(operator="op", operator_previous="op").tokens()) == 1  # not rotated: one token


def samples_with(client: TestClient, headers: dict[str, str]) -> dict[str, float]:
    text = client.get("/metrics", headers=headers).text
    return {
        s.labels["reason"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "opsd_controller_rejected_requests_total"
    }


TYPED_READS: dict[str, type[msgspec.Struct]] = {  # a read of the API -> the answer the CLI decodes it as
    "/v1/runs/job": RunStatus,
    "/v1/spares": SparePools,
    "/v1/runs/job/checkpoints": Checkpoints,
    "/v1/runs/job/cadence": CadenceView,
}


def standalone(schema: dict[str, Any], components: dict[str, Any]) -> dict[str, Any]:
    """``schema`` of the API's document with its components, as a schema of its own (``$defs``)."""
    text = json.dumps({**schema, "$defs": components}).replace("#/components/schemas/", "#/$defs/")
    found: dict[str, Any] = json.loads(text)
    return found


def test_the_document_describes_every_read_and_the_answers_fit_it(client: TestClient) -> None:
    client.post("/v1/heartbeat", json=heartbeat(), headers=AUTH)
    document = client.get("/openapi.json").json()
    components = document["components"]["schemas"]
    for path, methods in document["paths"].items():
        if "get" in methods:
            for kind, content in methods["get"]["responses"]["200"]["content"].items():
                assert content["schema"], f"GET {path} answers an undocumented shape of {kind}"
    for path, kind in TYPED_READS.items():
        documented = document["paths"][path.replace("/job", "/{run}")]["get"]["responses"]["200"]["content"]
        schema = standalone(documented["application/json"]["schema"], components)
        answer = client.get(path).json()
        jsonschema.Draft202012Validator(schema).validate(answer)  # the answer is what the document says
        assert isinstance(decode_answer(answer, kind, path), kind)  # ... and what the CLI decodes
    # the document refuses what the struct refuses: a status whose step is a word
    wrong = {**client.get("/v1/runs/job").json(), "step": "forty"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(standalone(components["RunStatus"], components)).validate(wrong)
    with pytest.raises(PermanentError, match=r"run status: Expected `int`, got `str` - at `\$.step`"):
        decode_answer(wrong, RunStatus, "run status")
