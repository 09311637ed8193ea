"""A fault-tolerant run on Kubernetes end to end, on the emulated cluster: the JobSet of
docs/examples/jobset-ft.yaml (2 replica groups of one node each, a spare), JobSet's controller and the scheduler
played with RestartJob (tests/kube/jobset.py), the controller with the Kubernetes backend and its informers and
reconciler as ``opsd serve --backend kubernetes`` builds them. No rank process: each group's rank is its agent's
heartbeats, which carry what the pod's downward API gives it (its group, and its Job's restart count as its
launch); an XID comes in a heartbeat as its agent sends it, and the controller's detection pass finds it.

- An XID on group 1's node: the node quarantined, the spare promoted, group 1's pod alone evicted and recreated on
  the spare (its Job's restart count 1: its launch); group 0's pod is never touched (the same pod, never deleted nor
  evicted), the JobSet never restarts whole, and the incident closes as a replica recovery once group 1 is back
  in the quorum. A report of group 1's stopped launch is not taken for the new one's, by this controller nor by
  one that takes over from the store.
- The same XID where the quorum needs both groups (``opsd.io/min-replicas: "2"``): every group stopped and relaunched,
  each Job recreated alone (the JobSet never restarts whole), the groups' launches and nodes as the cluster has
  them, and the incident closes as a whole-job restart. Such a stop told again (a controller that restarted) keeps
  off the pods recreated since.
- JobSet's feature gate RestartJob off: a Warning Event on the JobSet says so, and the group's relaunch, which
  never comes, fails saying why.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

from opsd.backends.kubernetes.api import KubeApi
from opsd.backends.kubernetes.backend import KubernetesBackend
from opsd.backends.kubernetes.cluster import (
    JOB_INDEX_LABEL,
    JOB_RESTART_ATTEMPT_LABEL,
    JOBSET_NAME_LABEL,
    QUARANTINE_TAINT,
)
from opsd.backends.kubernetes.config import KubernetesConfig
from opsd.controller.config import ControllerConfig
from opsd.controller.controller import Controller
from opsd.controller.port import Done, Pending
from opsd.controller.rows import GroupLaunch
from opsd.controller.state import StateStore
from opsd.policy.detection import DetectionConfig
from opsd.protocol.heartbeat import Heartbeat, HeartbeatEvent, HeartbeatFt, HeartbeatRank
from opsd.protocol.states import IncidentState, NodeRole, RunState
from opsd.protocol.steps import Launched, Stopped
from tests.kube.emulator import KubeEmulator
from tests.kube.jobset import JobSetPlayer, put_secrets_named
from tests.kube.machines import JOBSETS, Cluster, node
from tests.rows import stored
from tests.test_kubernetes_takeover import ScriptedKubelet
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
Json = dict[str, Any]
RUN, NAMESPACE = "llama-ft", "training"
CONFIG = ControllerConfig(
    step_timeout_s=20.0, step_retry_max_s=0.1, detection=DetectionConfig(heartbeat_floor_s=60, hang_floor_s=60)
)


def ft_jobset(min_replicas: int) -> Json:
    """docs/examples/jobset-ft.yaml as it is, with one node per group and the quorum's minimum given."""
    jobset: Json = yaml.safe_load((ROOT / "docs" / "examples" / "jobset-ft.yaml").read_text())
    jobset["metadata"]["annotations"]["opsd.io/min-replicas"] = str(min_replicas)
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    job["parallelism"] = job["completions"] = 1
    for c in job["template"]["spec"]["containers"]:  # quantities as the API server answers them: strings
        c["resources"] = {k: {q: str(v) for q, v in amounts.items()} for k, amounts in c["resources"].items()}
    return jobset


def launch_of(pod: Json) -> int | None:
    """OPSD_LAUNCH as the downward API gives it to the pod: its job-restart-attempt label ("" without it: none)."""
    value = pod["metadata"]["labels"].get(JOB_RESTART_ATTEMPT_LABEL, "")
    return int(value) if value else None


class FtCluster:
    """node-0 and node-1 for the groups, node-2 a spare; the run's JobSet; the controller and its informers."""

    def __init__(
        self,
        kube: KubeEmulator,
        store: StateStore,
        min_replicas: int,
        restart_job_gate: bool = True,
        config: ControllerConfig = CONFIG,
    ) -> None:
        self.kube = kube
        kube.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        for name in ("node-0", "node-1"):
            kube.put(node(name))
        kube.put(node("node-2", spare=True))
        played = ft_jobset(min_replicas)
        put_secrets_named(kube, played)  # checkpoint-s3, as the docs have it made
        kube.put(played)
        self.kubelet = ScriptedKubelet()
        self.player = JobSetPlayer(kube, self.kubelet, restart_job_gate=restart_job_gate)
        self.player.start()
        wait_for("both groups running", lambda: len(self.running()) == 2, 20)
        backend = KubernetesBackend(
            KubeApi(kube.api_client),
            KubernetesConfig(namespace="opsd", quarantines_per_hour=10, force_delete_after_s=1.0),
        )
        self.controller = Controller(store, config, backend)
        self.controller.recovery.threaded = False
        self.watched = Cluster(self.controller.backend, store)  # type: ignore[arg-type]
        self.store = store
        self.seq = 0

    def running(self) -> dict[str, Json]:
        """The run's pods running now, by name."""
        return {
            p["metadata"]["name"]: p
            for p in self.kube.objects("pods", NAMESPACE)
            if p["metadata"]["labels"].get(JOBSET_NAME_LABEL) == RUN
            and (p.get("status") or {}).get("phase") == "Running"
            and not p["metadata"].get("deletionTimestamp")
        }

    def group_pods(self) -> dict[int, Json]:
        return {int(p["metadata"]["labels"][JOB_INDEX_LABEL]): p for p in self.running().values()}

    def relaunched_pods(self, launches: dict[int, int]) -> dict[int, Json]:
        """Each group's pod running at its launch in ``launches``: the recovery's launch step is done when the pods
        are placed, and their kubelet (the JobSet player's thread) starts them a moment later."""

        def running() -> dict[int, Json] | None:
            pods = self.group_pods()
            return pods if {g: launch_of(p) for g, p in pods.items()} == launches else None

        return wait_for(f"the groups' pods running at launches {launches}", running, 20)

    def sync(self) -> None:
        self.watched.reconciler.sync(time.time())

    def beat(
        self,
        steps: dict[int, int],
        *,
        xid_on: str = "",
        xid: tuple[int, str] = (79, "cordon_and_swap"),
        stale: dict[int, tuple[str, int, int]] | None = None,
    ) -> None:
        """Each group's rank (rank g: group g, one per pod) at ``steps[g]``, from its pod's node, of the launch its
        pod's labels give it (OPSD_LAUNCH); ``stale``: group -> (node, launch, step) of a rank its agent still
        remembers; ``xid_on``: that node's agent also sends an XID (``xid``: its code and action; 79 by default)."""
        now = time.time()
        placed = {g: (p["spec"]["nodeName"], launch_of(p)) for g, p in self.group_pods().items()}
        ranks: dict[int, tuple[str, int | None, int]] = {g: (*placed[g], step) for g, step in steps.items()}
        ranks |= stale or {}
        for g, (where, launch, step) in ranks.items():
            ft = HeartbeatFt(
                replica_group=g, replica_groups=2, quorum_id=1, quorum_replicas=len(steps), participants=len(steps)
            )
            rank = HeartbeatRank(run=RUN, rank=g, step=step, step_s=0.1, last_report_unix_s=now, launch=launch, ft=ft)
            events = []
            if where == xid_on:
                self.seq += 1
                code, action = xid
                events = [
                    HeartbeatEvent(seq=self.seq, gpu=0, xid=code, time_s=now, action=action, reason=f"XID {code}")
                ]
            self.controller.heartbeat(Heartbeat(v=1, node=where, time_unix_s=now, ranks=[rank], events=events), now)

    def jobset_status(self) -> Json:
        found = self.kube.get(JOBSETS, NAMESPACE, RUN)
        assert found is not None
        return dict(found.get("status") or {})

    def touched(self) -> set[str]:
        """The pods opsd or JobSet deleted or evicted, by name."""
        return {
            r.path.split("/")[6]
            for r in self.kube.requests
            if r.method in ("DELETE", "POST") and f"/namespaces/{NAMESPACE}/pods/" in r.path
        }

    def close(self) -> None:
        self.player.stop()
        self.watched.close()


def started(kube: KubeEmulator, store: StateStore, cleanup: ExitStack, min_replicas: int, **options: Any) -> FtCluster:
    """The run found and its groups placed (the reconciler), both groups training at step 40."""
    cluster = FtCluster(kube, store, min_replicas, **options)
    cleanup.callback(cluster.close)

    def placed() -> bool:
        cluster.sync()
        row = store.run(RUN)
        return row is not None and all(g in row.groups and row.groups[g].nodes for g in (0, 1))

    wait_for("the groups placed", placed, 20)
    run = stored(store.run(RUN))
    assert (run.spec.replica_groups, run.spec.min_replicas) == (2, min_replicas)
    assert run.groups == {0: GroupLaunch(0, ("node-0",)), 1: GroupLaunch(0, ("node-1",))}
    cluster.beat({0: 40, 1: 40})
    cluster.controller.tick(time.time())
    return cluster


def test_an_xid_relaunches_its_replica_group_alone_and_the_other_never_stops(
    kube: KubeEmulator, store: StateStore, cleanup: ExitStack
) -> None:
    cluster = started(kube, store, cleanup, min_replicas=1)
    before = cluster.group_pods()
    group0 = (before[0]["metadata"]["name"], before[0]["metadata"]["uid"])

    cluster.beat({0: 41, 1: 41}, xid_on="node-1")
    (failure,) = cluster.controller.tick(time.time())  # detected; the group's recovery runs before it returns

    (incident,) = store.incidents(RUN)
    assert (incident.kind, incident.node, incident.replica_group, incident.spare) == (
        "fatal_xid",
        "node-1",
        1,
        "node-2",
    )
    actions = [(a.kind, a.args.get("group"), a.state) for a in store.actions(incident_id=int(incident.id))]
    assert actions == [
        ("cordon", None, "done"),
        ("take_spare", None, "done"),
        ("stop", 1, "done"),
        ("launch", 1, "done"),
    ]
    now = cluster.relaunched_pods({0: 0, 1: 1})
    assert (now[0]["metadata"]["name"], now[0]["metadata"]["uid"]) == group0  # the same pod, never recreated
    assert now[1]["spec"]["nodeName"] == "node-2"
    assert now[1]["metadata"]["labels"][JOB_RESTART_ATTEMPT_LABEL] == "1"
    assert cluster.touched() == {before[1]["metadata"]["name"]}  # group 1's pod alone, evicted once
    assert kube.count("POST", f"/api/v1/namespaces/{NAMESPACE}/pods/{before[1]['metadata']['name']}/eviction") == 1
    status = cluster.jobset_status()
    assert (status.get("restarts", 0), status["replicatedJobsStatus"][0]["jobRestarts"]) == (0, [0, 1])
    assert (cluster.player.restarts, cluster.player.job_restarts) == (0, 1)
    run = stored(store.run(RUN))
    assert run.state == RunState.RUNNING  # the run never stopped
    assert run.groups == {0: GroupLaunch(0, ("node-0",)), 1: GroupLaunch(1, ("node-2",))}  # its pods' launch
    quarantined = kube.get("nodes", None, "node-1")
    assert quarantined is not None
    assert QUARANTINE_TAINT in {t["key"] for t in quarantined["spec"]["taints"]}
    assert stored(store.node("node-2")).role == NodeRole.ACTIVE

    # group 0 trained on; group 1 healed to its step; node-1's agent still remembers group 1's stopped rank
    cluster.beat({0: 55}, stale={1: ("node-1", 0, 99)})
    assert cluster.controller.rank_groups(RUN) == {0: 0}  # the stopped launch's report is not taken
    cluster.beat({0: 56, 1: 55})
    cluster.controller.tick(time.time())
    closed = stored(store.incident(int(incident.id)))
    assert (closed.state, closed.replica_group, closed.lost_steps, closed.resumed_from_step) == (
        IncidentState.RECOVERED,
        1,
        0,
        55,
    )
    assert closed.missed_steps == 55 - 41  # group 0's steps while group 1 was out
    assert (failure.kind.value, failure.node) == ("fatal_xid", "node-1")

    # a controller that takes over knows each group's launch from the store: its pods' job-restart-attempt
    cluster.controller = Controller(store, CONFIG, cluster.controller.backend)
    cluster.controller.tick(time.time())
    cluster.beat({0: 57}, stale={1: ("node-1", 0, 99)})
    assert cluster.controller.rank_groups(RUN) == {0: 0}
    cluster.beat({0: 58, 1: 57})
    assert cluster.controller.rank_groups(RUN) == {0: 0, 1: 1}


def test_when_the_quorum_needs_every_group_every_group_is_relaunched(
    kube: KubeEmulator, store: StateStore, cleanup: ExitStack
) -> None:
    cluster = started(kube, store, cleanup, min_replicas=2)
    before = {g: p["metadata"]["name"] for g, p in cluster.group_pods().items()}

    cluster.beat({0: 41, 1: 41}, xid_on="node-1")
    cluster.controller.tick(time.time())

    (incident,) = store.incidents(RUN)
    assert incident.replica_group is None  # 1 group left, fewer than the quorum's 2: the whole job
    actions = [(a.kind, a.args.get("group")) for a in store.actions(incident_id=int(incident.id))]
    assert actions == [("cordon", None), ("take_spare", None), ("stop", None), ("launch", None)]
    stop, launch = (a.result for a in store.actions(incident_id=int(incident.id))[2:])
    assert (stop or {})["launches"] == [0, 0]  # each group's launch it stopped
    assert (launch or {})["launches"] == [1, 1]
    status = cluster.jobset_status()
    assert (status.get("restarts", 0), status["replicatedJobsStatus"][0]["jobRestarts"]) == (0, [1, 1])
    assert (cluster.player.restarts, cluster.player.job_restarts) == (0, 2)  # every Job recreated alone
    assert cluster.touched() == set(before.values())
    now = cluster.relaunched_pods({0: 1, 1: 1})
    assert {p["metadata"]["labels"][JOB_RESTART_ATTEMPT_LABEL] for p in now.values()} == {"1"}
    assert sorted(p["spec"]["nodeName"] for p in now.values()) == ["node-0", "node-2"]
    run = stored(store.run(RUN))
    assert (run.generation, run.state) == (2, RunState.RUNNING)
    assert run.groups == {
        g: GroupLaunch(1, (now[g]["spec"]["nodeName"],)) for g in (0, 1)
    }  # as the cluster placed them

    cluster.beat({}, stale={0: ("node-0", 0, 99)})  # node-0's agent still remembers the stopped launch's rank
    assert cluster.controller.rank_groups(RUN) == {}
    cluster.beat({0: 30, 1: 30})  # both resumed from the newest checkpoint
    assert cluster.controller.rank_groups(RUN) == {0: 0, 1: 1}
    cluster.controller.tick(time.time())
    closed = stored(store.incident(int(incident.id)))
    assert (closed.state, closed.replica_group) == (IncidentState.RECOVERED, None)
    assert closed.lost_steps == 41 - closed.resumed_from_step  # type: ignore[operator]


@pytest.mark.parametrize(
    ("xid", "restarts", "node_at_end"),
    [((13, "restart_job"), 1, "node-1"), ((79, "cordon_and_swap"), 2, "node-2")],
    ids=["an-application-error-one-restart", "a-dead-gpu-the-new-pod-leaves-the-node"],
)
def test_a_group_jobset_restarted_first_is_not_restarted_again(
    kube: KubeEmulator, store: StateStore, cleanup: ExitStack, xid: tuple[int, str], restarts: int, node_at_end: str
) -> None:
    """Group 1's rank dies of its XID and its pod fails before opsd's recovery stops it: JobSet's RestartJob
    recreates the Job at once. opsd's stop is of the launch the failure was seen in (0), so the Job's new pod is
    left be and the relaunch is JobSet's: one failure, one restart. Where the XID takes the node out (79), the new
    pod, placed on that node before opsd cordoned it, is moved off it: a second restart, to the spare."""
    cluster = started(kube, store, cleanup, min_replicas=1)
    before = cluster.group_pods()
    cluster.beat({0: 41, 1: 41}, xid_on="node-1", xid=xid)  # heard; the detection pass comes below
    cluster.kubelet.exits[before[1]["metadata"]["name"]] = 1  # the rank died of it: its pod fails
    new = cluster.relaunched_pods({0: 0, 1: 1})  # JobSet recreated group 1's Job first, on node-1 again
    assert new[1]["spec"]["nodeName"] == "node-1"

    cluster.controller.tick(time.time())  # detected; the group's recovery runs before it returns

    (incident,) = store.incidents(RUN)
    assert (incident.key, incident.replica_group) == (f"{RUN}/gen0/group1", 1)
    stop, launch = [a for a in store.actions(incident_id=int(incident.id)) if a.kind in ("stop", "launch")]
    assert (stop.args["group"], stop.state, launch.state) == (1, "done", "done")
    assert stop.outcome == Stopped(killed=restarts - 1, restart_attempt=0, launch=0)  # of the launch that failed
    assert isinstance(launch.outcome, Launched)
    assert launch.outcome.launch == restarts
    now = cluster.relaunched_pods({0: 0, 1: restarts})
    assert now[1]["spec"]["nodeName"] == node_at_end
    assert (now[0]["metadata"]["uid"]) == before[0]["metadata"]["uid"]  # group 0 never stopped
    assert cluster.player.job_restarts == restarts
    assert cluster.jobset_status()["replicatedJobsStatus"][0]["jobRestarts"] == [0, restarts]
    evictions = [r.path.split("/")[6] for r in kube.requests if r.method == "POST" and r.path.endswith("/eviction")]
    assert evictions == ([new[1]["metadata"]["name"]] if restarts == 2 else [])  # only to leave a dead node
    (told,) = [e for e in kube.objects("events", NAMESPACE) if e["reason"] == "OpsdEvict"]
    assert "restarted already (1) since its failed restart 0" in told["message"]
    assert stored(store.run(RUN)).groups[1] == GroupLaunch(restarts, (node_at_end,))


def test_a_group_jobset_restarted_on_its_own_earlier_is_stopped_at_the_launch_it_runs(
    kube: KubeEmulator, store: StateStore, cleanup: ExitStack
) -> None:
    """Group 1's pod failed once with no failure opsd saw (JobSet recreated its Job: launch 1, which its rank
    reports; opsd's record of the group still says launch 0). An application XID on it later: the incident is of the
    launch its ranks report, the stop evicts that launch's pod, and the group restarts (launch 2) rather than being
    taken for recovered by the restart that was there already."""
    cluster = started(kube, store, cleanup, min_replicas=1)
    before = cluster.group_pods()
    cluster.kubelet.exits[before[1]["metadata"]["name"]] = 1
    cluster.relaunched_pods({0: 0, 1: 1})
    cluster.beat({0: 45, 1: 30})  # group 1's rank of launch 1, resumed; opsd opened nothing
    assert store.incidents(RUN) == []
    assert stored(store.run(RUN)).groups[1].launch == 0

    cluster.beat({0: 46, 1: 31}, xid_on="node-1", xid=(13, "restart_job"))
    cluster.controller.tick(time.time())

    (incident,) = store.incidents(RUN)
    assert incident.key == f"{RUN}/gen1/group1"
    stop = next(a for a in store.actions(incident_id=int(incident.id)) if a.kind == "stop")
    assert stop.outcome == Stopped(killed=1, restart_attempt=1, launch=1)
    cluster.relaunched_pods({0: 0, 1: 2})
    assert cluster.player.job_restarts == 2


def test_without_jobsets_restart_job_gate_the_operator_is_told(
    kube: KubeEmulator, store: StateStore, cleanup: ExitStack, caplog: pytest.LogCaptureFixture
) -> None:
    """JobSet's RestartJob feature gate off (its webhook bypassed, or the gate turned off after the JobSet was
    admitted): its pods carry no job-restart-attempt, which the reconciler tells once in a Warning Event on the
    JobSet; a group's relaunch then never comes, and its step says why when it gives up."""
    config = ControllerConfig(
        step_timeout_s=2.0, step_retry_max_s=0.1, detection=DetectionConfig(heartbeat_floor_s=60, hang_floor_s=60)
    )
    cluster = started(kube, store, cleanup, min_replicas=1, restart_job_gate=False, config=config)
    cluster.sync()
    warned = [e for e in kube.objects("events", NAMESPACE) if e["reason"] == "OpsdRestartJobOff"]
    assert [(e["type"], e["involvedObject"]["name"]) for e in warned] == [("Warning", RUN)]  # once, for two passes
    assert "feature gate RestartJob is off" in warned[0]["message"]

    cluster.beat({0: 41, 1: 41}, xid_on="node-1")
    cluster.controller.tick(time.time())

    assert cluster.player.refused == [f"{RUN}-group-1"]
    assert stored(store.run(RUN)).state == RunState.FAILED
    assert "JobSet's feature gate RestartJob is off" in caplog.text


def test_a_whole_stop_told_again_never_evicts_the_groups_recreated_since(
    kube: KubeEmulator, store: StateStore, cleanup: ExitStack
) -> None:
    """A controller that restarted tells the stop again, after JobSet recreated the groups' Jobs: the restart count
    of each it wrote in the stop's Event keeps it off the new pods, and the relaunch finds every group recreated."""
    cluster = started(kube, store, cleanup, min_replicas=2)
    backend = cluster.controller.backend
    assert isinstance(backend, KubernetesBackend)
    first = backend.stop_ranks(RUN, "incident-9-2-stop")
    assert first == Done(Stopped(killed=2, launches=[0, 0]))
    wait_for("both groups recreated", lambda: {launch_of(p) for p in cluster.group_pods().values()} == {1}, 20)
    again = backend.stop_ranks(RUN, "incident-9-2-stop")
    assert again == Done(Stopped(killed=0, launches=[0, 0]))
    (event,) = [e for e in kube.objects("events", NAMESPACE) if e["reason"] == "OpsdEvict"]  # told once
    assert event["metadata"]["annotations"]["opsd.io/job-restarts"] == "0,0"

    def relaunched() -> Done[Launched] | None:
        """The relaunch, told again while it is pending, as the executor does: the groups' pods may be there before
        JobSet's status counts their Jobs' restarts, or before every one is placed."""
        outcome = backend.relaunch(RUN, 2, [], "incident-9-3-launch")
        assert isinstance(outcome, Done | Pending), outcome
        return outcome if isinstance(outcome, Done) else None

    launched = wait_for("the relaunch done", relaunched, 20)
    assert launched.data.launches == [1, 1]
    assert sorted(n for nodes in launched.data.group_nodes or [] for n in nodes) == ["node-0", "node-1"]
    assert cluster.player.job_restarts == 2
