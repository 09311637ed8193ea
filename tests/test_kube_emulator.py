"""The emulated Kubernetes API server (tests.kube) spoken to by the official client over real HTTP: the behaviours
the Kubernetes backend relies on, each as the real server shows them."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client import ApiException
from kubernetes.leaderelection import electionconfig, leaderelection
from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock
from kubernetes.watch import Watch

from tests.kube.emulator import KubeEmulator, kube_emulator
from tests.kube.patches import strategic_merge_patch
from tests.kube.selectors import Selector, parse_label_selector
from tests.waiting import wait_for

LEASES = "/apis/coordination.k8s.io/v1/namespaces/default/leases"
JOBSETS = ("jobset.x-k8s.io", "v1alpha2")
_SERIALIZER = client.ApiClient()


def as_json(answer: object) -> dict[str, Any]:
    """A client answer (a model, or a custom object's dict) as the server's JSON: camelCase, unset fields left out."""
    data = _SERIALIZER.sanitize_for_serialization(answer)
    assert isinstance(data, dict)
    return data


def status_of(exc: ApiException) -> dict[str, Any]:
    """The ``Status`` body of a failure, checked to carry the HTTP code."""
    body = json.loads(exc.body or "null")
    assert body["kind"] == "Status"
    assert body["code"] == exc.status
    return dict(body)


def pod(
    name: str,
    labels: dict[str, str] | None = None,
    node: str | None = None,
    phase: str | None = None,
    namespace: str = "default",
) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels or {}},
        "spec": {"containers": [{"name": "trainer", "image": "trainer:1"}]},
    }
    if node:
        obj["spec"]["nodeName"] = node
    if phase:
        obj["status"] = {"phase": phase}
    return obj


def pod_model(name: str, **fields: Any) -> client.V1Pod:
    model = client.V1Pod.from_dict(pod(name, **fields))
    assert model is not None
    return model


def meta(name: str, namespace: str | None = None) -> client.V1ObjectMeta:
    return client.V1ObjectMeta(name=name, namespace=namespace)


def eviction(name: str) -> client.V1Eviction:
    return client.V1Eviction(metadata=meta(name, "default"))


def list_rv(answer: object) -> str:
    rv = as_json(answer)["metadata"]["resourceVersion"]
    assert isinstance(rv, str)
    return rv


def watch_events(stream: Iterator[dict[str, Any]], until: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
    """Events of a watch stream up to and including the first one ``until`` accepts."""
    seen = []
    for event in stream:
        seen.append(event)
        if until(event):
            return seen
    raise AssertionError(f"the watch ended before the awaited event; saw {[e['type'] for e in seen]}")


@pytest.mark.parametrize(
    ("selector", "labels", "selected"),
    [
        pytest.param("a=b", {"a": "b"}, True, id="equals"),
        pytest.param("a==b", {}, False, id="equals-needs-the-label"),
        pytest.param("a!=b", {}, True, id="not-equals-holds-without-the-label"),
        pytest.param("a notin (x)", {}, True, id="notin-holds-without-the-label"),
        pytest.param("a in (x, y)", {"a": "y"}, True, id="in"),
        pytest.param("!a", {"a": ""}, False, id="does-not-exist"),
        pytest.param("a,b=", {"a": "1", "b": ""}, True, id="exists-and-empty-value"),
        pytest.param("opsd.io/pool=spare", {"opsd.io/pool": "spare"}, True, id="prefixed-key"),
    ],
)
def test_label_selectors_match_as_upstream(selector: str, labels: dict[str, str], selected: bool) -> None:
    assert Selector(labels=parse_label_selector(selector)).matches({"metadata": {"labels": labels}}) is selected


@pytest.mark.parametrize("selector", ["a in ()", "a=b=c", "=b", "a b", "a in (x"])
def test_malformed_label_selectors_are_refused(selector: str) -> None:
    with pytest.raises(ValueError, match=r"requirement|values set"):
        parse_label_selector(selector)


@pytest.mark.parametrize(
    ("current", "patch", "expected"),
    [
        pytest.param(
            {"spec": {"taints": [{"key": "a", "effect": "NoSchedule"}]}},
            {"spec": {"taints": [{"key": "b", "effect": "NoSchedule"}]}},
            {"spec": {"taints": [{"key": "b", "effect": "NoSchedule"}]}},
            id="taints-have-no-merge-key",
        ),
        pytest.param(
            {"status": {"conditions": [{"type": "Ready", "status": "True"}, {"type": "X", "status": "True"}]}},
            {"status": {"conditions": [{"type": "Ready", "status": "False"}, {"type": "Y", "status": "True"}]}},
            {
                "status": {
                    "conditions": [
                        {"type": "Ready", "status": "False"},
                        {"type": "X", "status": "True"},
                        {"type": "Y", "status": "True"},
                    ]
                }
            },
            id="conditions-merge-by-type",
        ),
        pytest.param(
            {"metadata": {"finalizers": ["a"], "labels": {"x": "1", "y": "2"}}},
            {"metadata": {"finalizers": ["b", "a"], "labels": {"x": None}}},
            {"metadata": {"finalizers": ["a", "b"], "labels": {"y": "2"}}},
            id="finalizers-merge-as-a-set-null-deletes",
        ),
    ],
)
def test_strategic_merge_patch(current: dict[str, Any], patch: dict[str, Any], expected: dict[str, Any]) -> None:
    assert strategic_merge_patch(current, patch) == expected


def test_create_get_and_list_with_label_and_field_selectors(kube: KubeEmulator) -> None:
    core = client.CoreV1Api(kube.api_client)
    core.create_namespace(client.V1Namespace(metadata=meta("team")))
    core.create_namespaced_pod("default", pod_model("a-0", labels={"app": "train", "tier": "gpu"}, node="n1"))
    core.create_namespaced_pod("default", pod_model("a-1", labels={"app": "train"}, node="n2"))
    core.create_namespaced_pod("default", pod_model("b-0", labels={"app": "eval"}))
    core.create_namespaced_pod(
        "team", pod_model("c-0", labels={"app": "train", "tier": "cpu"}, node="n1", namespace="team")
    )
    kube.put(pod("a-1", {"app": "train"}, node="n2", phase="Running"))  # its kubelet reports it running

    def names(label_selector: str | None = None, field_selector: str | None = None) -> list[str]:
        answer = core.list_pod_for_all_namespaces(label_selector=label_selector, field_selector=field_selector)
        return [item["metadata"]["name"] for item in as_json(answer)["items"]]

    read = as_json(core.read_namespaced_pod("a-0", "default"))
    assert read["metadata"]["labels"] == {"app": "train", "tier": "gpu"}
    assert read["status"] == {"phase": "Pending"}  # a create's status is the server's
    assert [i["metadata"]["name"] for i in as_json(core.list_namespaced_pod("default"))["items"]] == [
        "a-0",
        "a-1",
        "b-0",
    ]
    assert names(label_selector="app=train") == ["a-0", "a-1", "c-0"]
    assert names(label_selector="app==train,tier") == ["a-0", "c-0"]
    assert names(label_selector="tier!=gpu") == ["a-1", "b-0", "c-0"]  # also the pods without the label
    assert names(label_selector="!tier") == ["a-1", "b-0"]
    assert names(label_selector="tier in (gpu, cpu)") == ["a-0", "c-0"]
    assert names(label_selector="app notin (eval),tier notin (cpu)") == ["a-0", "a-1"]
    assert names(field_selector="spec.nodeName=n1") == ["a-0", "c-0"]
    assert names(field_selector="spec.nodeName=") == ["b-0"]  # unscheduled
    assert names(field_selector="status.phase=Running") == ["a-1"]
    assert names(field_selector="status.phase!=Running,metadata.namespace=default") == ["a-0", "b-0"]
    assert names(field_selector="metadata.name=c-0", label_selector="app=train") == ["c-0"]
    with pytest.raises(ApiException) as bad_label:
        core.list_namespaced_pod("default", label_selector="app in ()")
    assert (bad_label.value.status, status_of(bad_label.value)["reason"]) == (400, "BadRequest")
    with pytest.raises(ApiException) as bad_field:
        core.list_namespaced_pod("default", field_selector="spec.schedulerName=x")
    assert "field label not supported: spec.schedulerName" in status_of(bad_field.value)["message"]


def test_a_missing_object_is_404_and_a_taken_name_409(kube: KubeEmulator) -> None:
    core = client.CoreV1Api(kube.api_client)
    with pytest.raises(ApiException) as missing:
        core.read_namespaced_pod("nope", "default")
    assert status_of(missing.value) == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": 'pods "nope" not found',
        "reason": "NotFound",
        "code": 404,
        "details": {"name": "nope", "kind": "pods"},
    }
    core.create_namespaced_pod("default", pod_model("p"))
    with pytest.raises(ApiException) as taken:
        core.create_namespaced_pod("default", pod_model("p"))
    assert (taken.value.status, status_of(taken.value)["reason"]) == (409, "AlreadyExists")
    with pytest.raises(ApiException) as no_namespace:
        core.create_namespaced_pod("elsewhere", pod_model("p", namespace="elsewhere"))
    assert status_of(no_namespace.value)["message"] == 'namespaces "elsewhere" not found'
    with pytest.raises(ApiException) as not_served:
        core.list_namespaced_config_map("default")
    assert not_served.value.status == 404


def test_the_resource_version_grows_on_every_write_and_is_returned(kube: KubeEmulator) -> None:
    core = client.CoreV1Api(kube.api_client)
    created = as_json(core.create_namespaced_pod("default", pod_model("p", labels={"app": "train"})))["metadata"]
    assert created["uid"]
    assert created["creationTimestamp"]
    assert created["generation"] == 1
    labelled = as_json(core.patch_namespaced_pod("p", "default", {"metadata": {"labels": {"step": "1"}}}))["metadata"]
    assert int(labelled["resourceVersion"]) > int(created["resourceVersion"])
    assert labelled["generation"] == 1  # metadata is not counted
    respec = as_json(core.patch_namespaced_pod("p", "default", {"spec": {"activeDeadlineSeconds": 60}}))["metadata"]
    assert int(respec["resourceVersion"]) > int(labelled["resourceVersion"])
    assert respec["generation"] == 2
    assert (respec["uid"], respec["creationTimestamp"]) == (created["uid"], created["creationTimestamp"])
    same = as_json(core.patch_namespaced_pod("p", "default", {"metadata": {"labels": {"step": "1"}}}))["metadata"]
    assert same["resourceVersion"] == respec["resourceVersion"]  # a write that changes nothing takes no version
    listed = as_json(core.list_namespaced_pod("default"))
    assert int(listed["metadata"]["resourceVersion"]) == kube.resource_version >= int(respec["resourceVersion"])
    assert listed["items"][0]["metadata"]["resourceVersion"] == respec["resourceVersion"]


def test_a_replace_with_a_stale_resource_version_is_409(kube: KubeEmulator) -> None:
    coordination = client.CoordinationV1Api(kube.api_client)
    body = client.V1Lease(metadata=meta("l"), spec=client.V1LeaseSpec(holder_identity="a"))
    lease = coordination.create_namespaced_lease("default", body)
    assert lease.spec is not None
    assert lease.metadata is not None
    lease.spec.holder_identity = "b"
    replaced = as_json(coordination.replace_namespaced_lease("l", "default", lease))
    assert replaced["spec"]["holderIdentity"] == "b"
    assert int(replaced["metadata"]["resourceVersion"]) > int(str(lease.metadata.resource_version))
    lease.spec.holder_identity = "c"  # still the first read's resourceVersion
    with pytest.raises(ApiException) as stale:
        coordination.replace_namespaced_lease("l", "default", lease)
    assert (stale.value.status, status_of(stale.value)["reason"]) == (409, "Conflict")
    assert "the object has been modified" in status_of(stale.value)["message"]
    assert (kube.get("leases", "default", "l") or {})["spec"]["holderIdentity"] == "b"
    assert kube.count("PUT", f"{LEASES}/l") == 2
    lease.metadata.resource_version = None  # a Lease refuses an update without one
    with pytest.raises(ApiException) as unconditional:
        coordination.replace_namespaced_lease("l", "default", lease)
    assert unconditional.value.status == 422


def test_a_strategic_merge_patch_replaces_the_taint_list_and_merges_labels(kube: KubeEmulator) -> None:
    core = client.CoreV1Api(kube.api_client)
    kube.put(
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": "n1", "labels": {"gpu": "h100", "zone": "a"}},
            "spec": {"taints": [{"key": "opsd.io/spare", "value": "true", "effect": "NoSchedule"}]},
        }
    )
    quarantine = {"key": "opsd.io/quarantine", "value": "xid", "effect": "NoSchedule"}
    core.patch_node(
        "n1",
        {
            "metadata": {"labels": {"opsd.io/pool": "quarantine", "zone": None}},
            "spec": {"unschedulable": True, "taints": [quarantine]},
        },
    )
    node = kube.get("nodes", None, "n1") or {}
    assert node["spec"]["taints"] == [quarantine]  # no merge key: the list is replaced, the spare taint is gone
    assert node["spec"]["unschedulable"] is True
    assert node["metadata"]["labels"] == {"gpu": "h100", "opsd.io/pool": "quarantine"}
    patch = kube.requests[-1]
    assert (patch.method, patch.path) == ("PATCH", "/api/v1/nodes/n1")
    assert patch.content_type == "application/strategic-merge-patch+json"  # the client's choice for a dict body
    core.patch_node("n1", {"spec": {"taints": None}}, _content_type="application/merge-patch+json")
    assert "taints" not in (kube.get("nodes", None, "n1") or {})["spec"]


def test_a_json_patch_whose_test_fails_is_422_and_changes_nothing(kube: KubeEmulator) -> None:
    core = client.CoreV1Api(kube.api_client)
    taint = {"key": "opsd.io/spare", "value": "true", "effect": "NoSchedule"}
    stored = kube.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}, "spec": {"taints": [taint]}})
    guarded: list[dict[str, Any]] = [
        {"op": "test", "path": "/spec/taints", "value": []},
        {"op": "replace", "path": "/spec/taints", "value": []},
    ]
    with pytest.raises(ApiException) as failed:
        core.patch_node("n1", guarded)
    assert (failed.value.status, status_of(failed.value)["reason"]) == (422, "Invalid")
    assert kube.requests[-1].content_type == "application/json-patch+json"
    assert kube.get("nodes", None, "n1") == stored
    guarded[0]["value"] = [taint]
    core.patch_node("n1", [*guarded, {"op": "add", "path": "/metadata/labels", "value": {"opsd.io/pool": "busy"}}])
    node = kube.get("nodes", None, "n1") or {}
    assert node["spec"]["taints"] == []
    assert node["metadata"]["labels"] == {"opsd.io/pool": "busy"}


def test_a_patch_carrying_a_stale_resource_version_is_409(kube: KubeEmulator) -> None:
    core = client.CoreV1Api(kube.api_client)
    old_rv = kube.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})["metadata"]["resourceVersion"]
    core.patch_node("n1", {"metadata": {"resourceVersion": old_rv, "labels": {"a": "1"}}})  # current: accepted
    with pytest.raises(ApiException) as stale:
        core.patch_node("n1", {"metadata": {"resourceVersion": old_rv, "labels": {"a": "2"}}})
    assert (stale.value.status, status_of(stale.value)["reason"]) == (409, "Conflict")
    assert (kube.get("nodes", None, "n1") or {})["metadata"]["labels"] == {"a": "1"}


def test_an_eviction_marks_the_pod_disrupted_then_deletes_it(kube: KubeEmulator) -> None:
    core = client.CoreV1Api(kube.api_client)
    kube.put(pod("trainer-0", {"app": "train"}, node="n1", phase="Running"))
    since = list_rv(core.list_namespaced_pod("default"))
    core.create_namespaced_pod_eviction("trainer-0", "default", eviction("trainer-0"))
    assert kube.get("pods", "default", "trainer-0") is None
    assert kube.count("POST", "/api/v1/namespaces/default/pods/trainer-0/eviction") == 1
    watch = Watch()
    events = watch_events(
        watch.stream(core.list_namespaced_pod, "default", resource_version=since, timeout_seconds=5),
        until=lambda e: e["type"] == "DELETED",
    )
    watch.stop()
    assert [e["type"] for e in events] == ["MODIFIED", "MODIFIED", "DELETED"]  # condition, deletionTimestamp, gone
    gone = events[-1]["raw_object"]
    assert gone["metadata"]["deletionTimestamp"]
    [condition] = [c for c in gone["status"]["conditions"] if c["type"] == "DisruptionTarget"]
    assert (condition["status"], condition["reason"]) == ("True", "EvictionByEvictionAPI")


def test_evictions_refused_by_a_disruption_budget_answer_429(kube: KubeEmulator) -> None:
    core = client.CoreV1Api(kube.api_client)
    kube.put(pod("trainer-0", node="n1", phase="Running"))
    kube.put(pod("pending-0", phase="Pending"))
    kube.refuse_evictions(2, budget_name="trainers")
    for _ in range(2):
        with pytest.raises(ApiException) as refused:
            core.create_namespaced_pod_eviction("trainer-0", "default", eviction("trainer-0"))
        status = status_of(refused.value)
        assert (refused.value.status, status["reason"]) == (429, "TooManyRequests")
        assert status["details"]["causes"][0]["reason"] == "DisruptionBudget"
    assert "conditions" not in (kube.get("pods", "default", "trainer-0") or {})["status"]
    core.create_namespaced_pod_eviction("trainer-0", "default", eviction("trainer-0"))
    assert kube.get("pods", "default", "trainer-0") is None
    kube.refuse_evictions(1)
    core.create_namespaced_pod_eviction("pending-0", "default", eviction("pending-0"))
    assert kube.get("pods", "default", "pending-0") is None  # a budget does not guard a pending pod
    assert kube.count("POST", "/api/v1/namespaces/default/pods/trainer-0/eviction") == 3


def test_a_stuck_pod_stays_terminating_until_a_zero_grace_delete(kube: KubeEmulator) -> None:
    core = client.CoreV1Api(kube.api_client)
    kube.put(pod("trainer-0", node="n1", phase="Running"))
    kube.stick_terminating("default", "trainer-0")
    core.create_namespaced_pod_eviction("trainer-0", "default", eviction("trainer-0"))
    stuck = as_json(core.read_namespaced_pod("trainer-0", "default"))
    assert stuck["metadata"]["deletionTimestamp"]
    assert stuck["metadata"]["deletionGracePeriodSeconds"] == 30
    assert [c["type"] for c in stuck["status"]["conditions"]] == ["DisruptionTarget"]
    core.delete_namespaced_pod("trainer-0", "default")  # graceful again: still there
    assert kube.get("pods", "default", "trainer-0") is not None
    core.delete_namespaced_pod("trainer-0", "default", grace_period_seconds=0)
    assert kube.get("pods", "default", "trainer-0") is None


def test_a_watch_from_a_compacted_resource_version_gets_410_and_a_relist_recovers(kube: KubeEmulator) -> None:
    core = client.CoreV1Api(kube.api_client)
    kube.put(pod("p0"))
    old = list_rv(core.list_namespaced_pod("default"))
    kube.put(pod("p1"))
    kube.compact()
    with pytest.raises(ApiException) as expired:
        next(iter(Watch().stream(core.list_namespaced_pod, "default", resource_version=old, timeout_seconds=5)))
    assert expired.value.status == 410
    assert "Expired: too old resource version" in str(expired.value.reason)
    listed = as_json(core.list_namespaced_pod("default"))
    assert [i["metadata"]["name"] for i in listed["items"]] == ["p0", "p1"]
    kube.put(pod("p2"))
    watch = Watch()
    events = watch_events(
        watch.stream(
            core.list_namespaced_pod,
            "default",
            resource_version=listed["metadata"]["resourceVersion"],
            timeout_seconds=5,
        ),
        until=lambda e: e["raw_object"]["metadata"]["name"] == "p2",
    )
    watch.stop()
    assert [(e["type"], e["raw_object"]["metadata"]["name"]) for e in events] == [("ADDED", "p2")]


def test_a_live_watch_applies_its_selector_and_sees_objects_enter_and_leave(kube: KubeEmulator) -> None:
    core = client.CoreV1Api(kube.api_client)
    since = list_rv(core.list_namespaced_pod("default"))

    def writes() -> None:
        wait_for("watch request", lambda: kube.count("GET", "/api/v1/namespaces/default/pods") >= 2, 10)
        kube.put(pod("in", {"app": "train"}))
        kube.put(pod("out", {"app": "eval"}))
        kube.put(pod("out", {"app": "train"}))  # enters the selection
        kube.put(pod("in", {"app": "eval"}))  # leaves it
        kube.remove("pods", "default", "out")

    writer = threading.Thread(target=writes)
    writer.start()
    watch = Watch()
    stream = watch.stream(
        core.list_namespaced_pod, "default", label_selector="app=train", resource_version=since, timeout_seconds=10
    )
    events = watch_events(
        stream, until=lambda e: (e["type"], e["raw_object"]["metadata"]["name"]) == ("DELETED", "out")
    )
    watch.stop()
    writer.join(timeout=10)
    assert [(e["type"], e["raw_object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "in"),
        ("ADDED", "out"),
        ("DELETED", "in"),
        ("DELETED", "out"),
    ]


def test_bookmarks_arrive_and_carry_the_current_resource_version() -> None:
    with kube_emulator(bookmark_interval_s=0.2) as kube:
        core = client.CoreV1Api(kube.api_client)
        kube.put(pod("p0"))
        since = list_rv(core.list_namespaced_pod("default"))
        kube.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}})  # another resource moves on
        watch = Watch()
        stream = watch.stream(
            core.list_namespaced_pod, "default", resource_version=since, allow_watch_bookmarks=True, timeout_seconds=5
        )
        events = watch_events(stream, until=lambda e: e["type"] == "BOOKMARK")
        watch.stop()
        assert [e["type"] for e in events] == ["BOOKMARK"]
        assert events[0]["raw_object"]["metadata"]["resourceVersion"] == str(kube.resource_version)
        assert watch.resource_version == str(kube.resource_version)  # the client resumes from the bookmark


def test_jobsets_through_the_custom_objects_api(kube: KubeEmulator) -> None:
    custom = client.CustomObjectsApi(kube.api_client)
    resources = as_json(custom.get_api_resources(*JOBSETS))["resources"]
    assert {(r["name"], r["kind"], r["namespaced"]) for r in resources} == {
        ("jobsets", "JobSet", True),
        ("jobsets/status", "JobSet", True),
    }
    body = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": "llama", "labels": {"opsd.io/run": "r1"}},
        "spec": {"replicatedJobs": [{"name": "workers", "replicas": 2}]},
        "status": {"restarts": 7},
    }
    created = as_json(custom.create_namespaced_custom_object(*JOBSETS, "default", "jobsets", body))
    assert created["metadata"]["generation"] == 1
    assert "status" not in created  # written through the status subresource only
    kube.put({**created, "status": {"restarts": 1}})  # the JobSet controller's write
    listed = as_json(
        custom.list_namespaced_custom_object(*JOBSETS, "default", "jobsets", label_selector="opsd.io/run=r1")
    )
    assert [(i["kind"], i["status"]["restarts"]) for i in listed["items"]] == [("JobSet", 1)]
    suspended = as_json(
        custom.patch_namespaced_custom_object(*JOBSETS, "default", "jobsets", "llama", {"spec": {"suspend": True}})
    )
    assert suspended["spec"]["suspend"] is True
    assert suspended["metadata"]["generation"] == 2
    assert kube.requests[-1].content_type == "application/merge-patch+json"  # the client's default for custom objects
    with pytest.raises(ApiException) as strategic:
        custom.patch_namespaced_custom_object(
            *JOBSETS,
            "default",
            "jobsets",
            "llama",
            {"spec": {"suspend": False}},
            _content_type="application/strategic-merge-patch+json",
        )
    assert strategic.value.status == 415  # a custom resource takes no strategic merge patch


class StopLeadingError(Exception):
    """Raised by a test's leader callback to make its elector stop renewing."""


def test_leader_election_renews_by_put_and_fails_over(kube: KubeEmulator) -> None:
    coordination = client.CoordinationV1Api(kube.api_client)
    started = {name: threading.Event() for name in ("a", "b")}
    stop = {name: threading.Event() for name in ("a", "b")}
    stopped = {name: threading.Event() for name in ("a", "b")}

    def candidate(identity: str) -> threading.Thread:
        lock = LeaseLock("opsd-controller", "default", identity)
        lock.api_instance = coordination  # LeaseLock otherwise builds its client on the default configuration

        def lead() -> None:
            started[identity].set()
            stop[identity].wait()
            raise StopLeadingError(identity)

        config = electionconfig.Config(
            lock,
            lease_duration=2,
            renew_deadline=1.5,
            retry_period=1,
            onstarted_leading=lead,
            onstopped_leading=stopped[identity].set,
        )
        config.retry_period = 0.2  # Config refuses periods under 1 s; the election loop takes any
        thread = threading.Thread(target=leaderelection.LeaderElection(config).run, daemon=True, name=identity)
        thread.start()
        return thread

    def renewals_by(identity: str) -> int:
        return sum(
            1
            for r in kube.requests
            if (r.method, r.path) == ("PUT", f"{LEASES}/opsd-controller")
            and r.json()["spec"]["holderIdentity"] == identity
        )

    def holder() -> str:
        lease = as_json(coordination.read_namespaced_lease("opsd-controller", "default"))
        return str(lease["spec"]["holderIdentity"])

    threads = [candidate("a")]
    try:
        wait_for("leadership of a", started["a"].is_set, 10)
        threads.append(candidate("b"))
        first = renewals_by("a")
        wait_for("four renewals by a", lambda: renewals_by("a") >= first + 4, 10)
        assert not started["b"].is_set()
        assert not stopped["a"].is_set()
        assert holder() == "a"
        stop["a"].set()  # a stops renewing; b takes over once the lease has run out
        wait_for("end of the leadership of a", stopped["a"].is_set, 10)
        wait_for("takeover by b", started["b"].is_set, 10)
        assert holder() == "b"
        assert kube.count("POST", LEASES) == 1  # created once, by a; every later write was a PUT
    finally:
        for event in stop.values():
            event.set()
        for thread in threads:
            thread.join(timeout=10)
    assert not any(thread.is_alive() for thread in threads)
