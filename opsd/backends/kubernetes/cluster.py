"""The names opsd reads and writes on Kubernetes objects: what a user's JobSet and the cluster's nodes carry for
opsd, and what opsd puts on them (docs/kubernetes.md). They are a contract with the users' manifests and the Helm
chart, so they are spelled here once.

- A run is a JobSet annotated ``opsd.io/run: <name>`` (``RUN_ANNOTATION``); its pods select its nodes with the
  node label ``opsd.io/run=<name>`` (``RUN_LABEL``), which opsd gives to a promoted spare. Optional annotations of
  the JobSet: ``opsd.io/checkpoint-url`` (where its ranks checkpoint), ``opsd.io/on-no-spare`` (``wait`` or
  ``shrink``) and ``opsd.io/min-nodes``; a fault-tolerant run's ``opsd.io/replica-groups`` (its child Jobs, one per
  replica group) and ``opsd.io/min-replicas`` (the fewest groups a quorum has: the Lighthouse's ``min_replicas``).
- Hot spares are nodes labelled ``opsd.io/pool=spare`` and tainted ``opsd.io/spare=true:NoSchedule``: only
  DaemonSets (opsd's agent among them) run there, so spares are health-checked too.
- A quarantined node has ``spec.unschedulable: true``, the taint ``opsd.io/quarantine=<cause>:NoSchedule``, the
  label ``opsd.io/state=quarantined`` and annotations with the incident, the reason and the time.
- JobSet's own names: its pods carry ``jobset.sigs.k8s.io/jobset-name`` and ``jobset.sigs.k8s.io/restart-attempt``;
  with JobSet's feature gate ``RestartJob`` (v0.12+), also ``jobset.sigs.k8s.io/job-restart-attempt``.
"""

from __future__ import annotations

PREFIX = "opsd.io"
RUN_ANNOTATION = "opsd.io/run"
CHECKPOINT_URL_ANNOTATION = "opsd.io/checkpoint-url"
ON_NO_SPARE_ANNOTATION = "opsd.io/on-no-spare"
MIN_NODES_ANNOTATION = "opsd.io/min-nodes"
REPLICA_GROUPS_ANNOTATION = "opsd.io/replica-groups"
MIN_REPLICAS_ANNOTATION = "opsd.io/min-replicas"

RUN_LABEL = "opsd.io/run"  # on a node: the run whose pods it takes
POOL_LABEL = "opsd.io/pool"  # "spare": in the hot-spare pool
SPARE_POOL = "spare"
STATE_LABEL = "opsd.io/state"  # "quarantined", "spare", "active": what opsd made of the node
SPARE_TAINT = "opsd.io/spare"  # value "true", effect NoSchedule
QUARANTINE_TAINT = "opsd.io/quarantine"  # value: the failure kind, effect NoSchedule

INCIDENT_ANNOTATION = "opsd.io/incident"
REASON_ANNOTATION = "opsd.io/reason"
QUARANTINED_AT_ANNOTATION = "opsd.io/quarantined-at"  # RFC 3339, UTC
CORDONED_BY_OPSD_ANNOTATION = "opsd.io/cordoned-by-opsd"  # "true": opsd set spec.unschedulable (and may unset it)

ROLE_LABEL = "opsd.io/role"  # on a controller's pod: "leader" or "standby" (the Service selects the leader)
LEADER, STANDBY = "leader", "standby"

JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
RANK_KEY_SECRET_PREFIX = "opsd-rank-key-"  # + the run: the Secret of the run's key, in its JobSet's namespace

RESTART_ATTEMPT_LABEL = "jobset.sigs.k8s.io/restart-attempt"
#: a child Job's index in its replicated job (a fault-tolerant run's replica group), and how many times JobSet's
#: ``RestartJob`` failure policy recreated that Job alone (JobSet 0.12+, feature gate ``RestartJob``)
JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
JOB_RESTART_ATTEMPT_LABEL = "jobset.sigs.k8s.io/job-restart-attempt"
JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
#: the oldest JobSet release with what opsd's runs use (failurePolicy rules on PodFailurePolicy,
#: RestartJobSetAndIgnoreMaxRestarts)
JOBSET_MIN_RELEASE = "v0.6.0"
#: the oldest JobSet release that recreates a failed child Job alone (RestartJob, behind its feature gate
#: RestartJob): what a fault-tolerant run's replica groups need
JOBSET_RESTART_JOB_RELEASE = "v0.12.0"


def rank_key_secret(run: str) -> str:
    """The name of the Secret that holds ``run``'s key (key ``key``), which its pods take as ``$OPSD_RANK_KEY``."""
    return RANK_KEY_SECRET_PREFIX + run
