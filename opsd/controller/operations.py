"""What an operator asks of the controller (through the API and the CLI): a graceful restart of a run, a node taken
out of service or put back, a fault injected. Each is recorded or carried out through the backend port."""

from __future__ import annotations

import logging
import re
import uuid

from opsd.controller.dry_run import record_dry_run
from opsd.controller.incidents import failure_key
from opsd.controller.needs import OperationsNeeds
from opsd.controller.port import Attaching, Done, ErrorKind, Failed, Fault, Outcome
from opsd.controller.rows import RunRow
from opsd.errors import BodyError, NotFoundError, PermanentError, TransientError
from opsd.policy.detection import Failure, FailureKind
from opsd.protocol.records import IncidentRow, NodeRow
from opsd.protocol.states import NodeRole, RunState
from opsd.protocol.steps import NodeChanged

log = logging.getLogger(__name__)

#: a run name (as a label value: a backend may put it on its nodes)
RUN_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


def raise_failed(outcome: Failed, what: str) -> None:
    """Turn a backend's error (data) into opsd's exception of the same kind: a step refused for what it asked
    (``PERMANENT``) is a ``BodyError``, one the backend cannot do (``UNSUPPORTED``) a ``PermanentError``."""
    message = f"{what}: {outcome.message}"
    if outcome.kind is ErrorKind.TRANSIENT:
        raise TransientError(message, outcome.retry_after_s)
    if outcome.kind is ErrorKind.NOT_FOUND:
        raise NotFoundError(message)
    if outcome.kind is ErrorKind.PERMANENT:
        raise BodyError(message)
    raise PermanentError(message)


class Operations:
    def __init__(self, core: OperationsNeeds) -> None:
        self.core = core

    def request_restart(self, run_id: str, reason: str, now_s: float) -> IncidentRow:
        """An operator's restart of every rank of a running run: recorded as a ``manual_restart`` incident and
        carried out by the recovery executor (a checkpoint first, when the ranks are progressing). Raises
        ``NotFoundError`` for an unknown run, ``PermanentError`` when it is not running, a recovery is under way, or
        there is no backend."""
        run = self.core.store.run(run_id)
        if run is None:
            raise NotFoundError(f"no run {run_id!r}")
        if self.core.backend is None:
            raise PermanentError("this controller has no backend to restart ranks with")
        if run.state != RunState.RUNNING:
            raise PermanentError(f"run {run_id!r} is {run.state}: only a running run can be restarted")
        cause = Failure(FailureKind.MANUAL_RESTART, "", None, f"restart asked: {reason}")
        incident = self._operators_incident(run, cause, now_s)
        self.core.store.update_run(run_id, now_s, state=RunState.RECOVERING)
        self.core.recovery.start(run_id, incident, cause, now_s)
        found = self.core.store.incident(incident)
        assert found is not None
        return found

    def _operators_incident(self, run: RunRow, cause: Failure, now_s: float) -> int:
        """Open the incident of an operator's action on ``run`` (its launch's, once); ``PermanentError`` when the run
        is already recovering."""
        incident, new = self.core.store.open_incident(
            key=failure_key(run.id, int(run.generation)),
            run=run.id,
            kind=cause.kind.value,
            node=cause.node,
            rank=None,
            detail=cause.detail,
            failed_s=now_s,
            detected_s=now_s,
        )
        if not new:
            raise PermanentError(f"run {run.id!r} is already recovering (incident {incident})")
        self.core.tracing.assign(self.core.store, incident)
        log.warning("run %s: incident %d: %s (node %s)", run.id, incident, cause.detail, cause.node or "-")
        return incident

    def drill_xid(self, run_id: str, node: str, gpu: int, xid: int, now_s: float) -> IncidentRow:
        """An operator's rehearsal of a fatal XID on ``node`` of a running run, where no GPU fault can be made (a
        real cluster): a ``fatal_xid`` incident whose detail says it is a drill, recovered from as a real one is
        (the node quarantined, a spare taken, the ranks stopped and relaunched from the newest checkpoint); in dry
        run, its plan recorded and nothing done. Give the node back with ``opsd uncordon`` after. Raises
        ``NotFoundError`` for an unknown run, ``PermanentError`` when it is not running, a recovery is under way,
        the node is not one of its active nodes, or there is no backend."""
        run = self.core.store.run(run_id)
        if run is None:
            raise NotFoundError(f"no run {run_id!r}")
        if self.core.backend is None:
            raise PermanentError("this controller has no backend to recover with")
        if run.state != RunState.RUNNING:
            raise PermanentError(f"run {run_id!r} is {run.state}: a drill needs a running run")
        active = sorted(n.name for n in self.core.store.nodes(run_id) if n.role == NodeRole.ACTIVE)
        if node not in active:
            raise PermanentError(f"node {node!r} is not one of run {run_id!r}'s active nodes ({', '.join(active)})")
        cause = Failure(
            FailureKind.FATAL_XID, node, None, f"drill: XID {xid} on GPU {gpu}, rehearsed by an operator (no GPU fault)"
        )
        incident = self._operators_incident(run, cause, now_s)
        if self.core.config.dry_run:
            record_dry_run(self.core.store, run, incident, cause, now_s)
        else:
            self.core.store.update_run(run_id, now_s, state=RunState.RECOVERING)
            self.core.recovery.start(run_id, incident, cause, now_s)
        found = self.core.store.incident(incident)
        assert found is not None
        return found

    def set_node_role(self, node: str, role: NodeRole, reason: str, now_s: float) -> NodeRow:
        """An operator takes a node out of service (``cordoned``) or puts it back in its run's spare pool
        (``spare``): the backend acts on the machine first, then the state store follows. Raises ``NotFoundError``
        for an unknown node, and the backend's error when it refuses."""
        if self.core.store.node(node) is None:
            raise NotFoundError(f"no node {node!r}")
        if self.core.backend is not None:
            request_id = f"operator-{uuid.uuid4().hex}"
            known = self.core.store.node(node)
            outcome: Outcome[NodeChanged]
            if role is NodeRole.CORDONED:
                outcome = self.core.backend.quarantine_node(
                    (known.run if known else None) or "", node, reason, request_id
                )
            else:
                outcome = self.core.backend.release_node(node, request_id)
            if isinstance(outcome, Failed):
                raise_failed(outcome, f"node {node}")
        self.core.store.upsert_node(node, now_s, role=role, reason=reason)
        log.info("node %s is now %s%s", node, role, f" ({reason})" if reason else "")
        found = self.core.store.node(node)
        assert found is not None
        return found

    def attach_run(self, target: str, run: str, now_s: float) -> RunRow:
        """Make ``target``, a job of the backend's machines in its own words (Kubernetes: ``NAMESPACE/JOBSET``, a
        JobSet without the ``opsd.io/run`` annotation, such as a Kubeflow TrainJob's), a run named ``run`` (default:
        the backend's name for it); the backend finds it at its next pass. Idempotent. Raises ``BodyError`` for a
        bad target or name, a run of that name that is another job's, or a backend that attaches nothing."""
        if not isinstance(self.core.backend, Attaching):
            name = self.core.backend.name if self.core.backend is not None else "none"
            raise BodyError(f"this controller's backend ({name}) attaches nothing: opsd serve --backend names one")
        name, spec = self.core.backend.attach_spec(target)
        run = run or name
        if not RUN_NAME.match(run):
            raise BodyError(f"run name {run!r}: letters, digits, '-', '_' and '.', at most 63, alphanumeric ends")
        if not self.core.store.create_run(run, spec, now_s):
            known = self.core.store.run(run)
            if known is None or (known.spec.backend, known.spec.own) != (spec.backend, spec.own):
                raise BodyError(f"run {run!r} exists already and is not {target}: choose --name")
        else:
            log.info("run %s: %s attached", run, target)
        found = self.core.store.run(run)
        assert found is not None
        return found

    def inject(self, run: str, fault: Fault) -> str:
        """Inject a fault into ``run`` through the backend; what was done, in words. Raises ``NotFoundError`` for an
        unknown run, and the backend's error (as opsd's) when it cannot."""
        if self.core.store.run(run) is None:
            raise NotFoundError(f"no run {run!r}")
        if self.core.backend is None:
            raise PermanentError("this controller has no backend to inject faults with")
        outcome = self.core.backend.inject(run, fault, f"operator-{uuid.uuid4().hex}")
        if isinstance(outcome, Failed):
            raise_failed(outcome, f"inject {fault.kind}")
        assert isinstance(outcome, Done)
        done = outcome.data.injected
        log.warning("fault injected into run %s: %s", run, done)
        return done
