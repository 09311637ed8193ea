"""The states and kinds the controller records and its API answers: of runs, nodes, incidents and recovery actions.

They cross process boundaries (the state store, the API, the CLI and the post-mortem read them), so they are
string enums: a member is equal to its value, is stored and sent as that string, and an unknown string from
outside is refused where it is turned into a member.
"""

from __future__ import annotations

from enum import StrEnum


class RunState(StrEnum):
    RUNNING = "running"
    RECOVERING = "recovering"  # a recovery is under way: detection leaves the run alone
    WAITING_FOR_SPARE = "waiting_for_spare"  # a swap found no spare: the recovery goes on once one is there
    COMPLETED = "completed"  # every rank of its launch exited 0
    FAILED = "failed"  # a recovery failed, or the run outlived its time limit
    STOPPED = "stopped"  # an operator stopped it

    @property
    def finished(self) -> bool:
        return self in (RunState.COMPLETED, RunState.FAILED, RunState.STOPPED)


class ApiRole(StrEnum):
    """Who calls the controller's API, each with a token of its own (docs/kubernetes.md, "Credentials")."""

    OPERATOR = "operator"  # every endpoint: restarts, cordons
    READER = "reader"  # every read, /metrics
    AGENT = "agent"  # heartbeats and Flight Recorder uploads
    METRICS = "metrics"  # /metrics alone (Prometheus)


class NodeRole(StrEnum):
    ACTIVE = "active"  # runs ranks of its run
    SPARE = "spare"  # in its run's hot-spare pool
    CORDONED = "cordoned"  # out of service (quarantined by a recovery, or by an operator) until uncordoned


class IncidentState(StrEnum):
    OPEN = "open"  # being recovered from
    RECOVERED = "recovered"  # the relaunch made its first productive step
    ABANDONED = "abandoned"
    WARNED = "warned"  # a warning (a straggler): nothing to recover
    DRY_RUN = "dry_run"  # seen by a controller in dry run: its plan recorded, no step of it taken


class IncidentKind(StrEnum):
    """What an incident records: a failure (``FAILURE_KINDS``: the kinds ``opsd.policy.detection`` names a
    ``Failure`` with), or a warning (``WARNING_KINDS``: a straggler, an agent down while its ranks train)."""

    HEARTBEAT_LOSS = "heartbeat_loss"  # a node stopped sending heartbeats
    FATAL_XID = "fatal_xid"  # a GPU error that calls for the node to be swapped
    APPLICATION_XID = "application_xid"  # a GPU error that calls for the job to be restarted
    PROCESS_EXIT = "process_exit"  # a rank exited
    HANG = "hang"  # no step progress
    COLLECTIVE_TIMEOUT = "collective_timeout"  # ranks waited on a collective past its timeout
    CONTROLLER_RESTART = "controller_restart"  # a controller took up a run whose own controller stopped
    MANUAL_RESTART = "manual_restart"  # an operator asked for a restart
    NO_QUORUM = "no_quorum"  # a fault-tolerant replica group found no quorum: too few groups alive for too long
    STRAGGLER = "straggler"  # a warning: a rank persistently slower than its peers
    AGENT_DOWN = "agent_down"  # a warning: a node's agent is silent while its ranks train (an operations event)


#: the incident kinds that are warnings: recorded, never recovered from
WARNING_KINDS = frozenset({IncidentKind.STRAGGLER, IncidentKind.AGENT_DOWN})

#: the incident kinds that record a failure
FAILURE_KINDS = frozenset(k for k in IncidentKind if k not in WARNING_KINDS)


class ActionState(StrEnum):
    PENDING = "pending"  # recorded, not known to be done (carried out again after a controller restart)
    DONE = "done"
    NOT_TAKEN = "not_taken"  # planned by a controller in dry run, never carried out


class ActionKind(StrEnum):
    """The steps of a recovery, in the order a plan puts them (``opsd.policy.recovery``)."""

    CHECKPOINT = "checkpoint"  # a graceful restart's: a checkpoint at a step every rank agrees on, awaited
    DUMP = "dump"  # a hang's: the ranks' Flight Recorder dumps, asked for and awaited
    STOP = "stop"  # every rank of the launch
    CORDON = "cordon"  # quarantine the failed node
    TAKE_SPARE = "take_spare"  # promote a spare in its place
    LAUNCH = "launch"  # relaunch the ranks (the next generation), resuming from the newest checkpoint
