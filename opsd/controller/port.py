"""The Backend port: the machine-level steps the controller asks of the machines a run is on.

The recovery plan and its execution (record a step, skip it when done, take it up after a restart) belong to the
controller (``opsd.controller.recovery``); a backend only carries out one step at a time. Each package of
``opsd.backends`` implements this port (``fake`` is an in-memory one for tests), and so does a plug-in's
(``opsd.runtime.registry``). One contract test suite (``tests/backend_contract.py``) runs against each.

What every method may assume, and must honour:

- **Idempotent for its request id.** A step called again with the same ``request_id`` does what it does at most
  once and answers the same outcome: the controller records a step before calling it and marks it done after, so
  a controller that dies in between calls it again after its restart (or another replica does).
- **Eventually consistent.** A step's effect may show later than its answer (a cluster's scheduler, a watch that
  lags); the controller never reads a backend's effect back to decide the next step of the same recovery.
- **May be called again after a crash**, of the controller or of the backend's own process: what a backend must
  remember to stay idempotent it keeps where a crash does not lose it (the cluster's objects), or it rebuilds
  it from what it finds (a local backend takes up what a dead controller left).
- **Errors are data.** A step answers ``Done`` with what it did (a struct of ``opsd.protocol.steps``: recorded as
  the action's result),
  ``Pending`` when it is under way and must be asked again (pods being scheduled), or ``Failed`` with the kind of
  error and a message; it raises only for a bug. ``TRANSIENT`` is retried after ``retry_after_s``; the others fail
  the recovery.
- **Short.** A step returns within seconds; waiting (for dumps, for a checkpoint, for pods to come back) is the
  controller's business: it asks a ``Pending`` step again until it is done.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, Protocol, TypeVar, runtime_checkable

from opsd.controller.rows import RunSpec
from opsd.protocol.steps import DumpReady, Injected, Launched, NodeChanged, Stopped

T = TypeVar("T", covariant=True)


class ErrorKind(StrEnum):
    TRANSIENT = "transient"  # worth retrying after retry_after_s (a 429, a 503, a conflict, a lost connection)
    PERMANENT = "permanent"  # bad input, or a refused permission: retrying will not help
    NOT_FOUND = "not_found"  # the run, node or rank named does not exist here
    UNSUPPORTED = "unsupported"  # this backend cannot do this (fault injection on a real cluster)


@dataclass(frozen=True)
class Done(Generic[T]):
    """A step carried out (or found done already); ``data`` is what it did (the struct of the step's kind,
    ``opsd.protocol.steps``: recorded as the action's result)."""

    data: T

    ok = True


class _AskedAgain:
    """What ``Pending`` and ``Failed`` check alike: the seconds before the step is asked again are not negative."""

    retry_after_s: float

    def __post_init__(self) -> None:
        if self.retry_after_s < 0:
            raise ValueError(f"{type(self).__name__}.retry_after_s must be >= 0")


@dataclass(frozen=True)
class Pending(_AskedAgain):
    """A step under way that the backend cannot finish at once (a cluster's scheduler placing pods): ask again after
    ``retry_after_s``. The controller waits up to ``step_timeout_s`` for it."""

    message: str
    retry_after_s: float = 1.0

    ok = False


@dataclass(frozen=True)
class Failed(_AskedAgain):
    """A step that could not be carried out."""

    kind: ErrorKind
    message: str
    retry_after_s: float = 1.0

    ok = False


Outcome = Done[T] | Pending | Failed


class FaultKind(StrEnum):
    XID = "xid"  # an XID event on a node's GPU
    KILL = "kill"  # SIGKILL a rank
    HANG = "hang"  # SIGSTOP a rank
    SLOW = "slow"  # a rank slowed down by a factor


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    node: str = ""
    gpu: int = 0
    xid: int = 79
    rank: int = -1
    factor: float = 1.3


@runtime_checkable
class NodeWitness(Protocol):
    """A backend that can tell whether a node is up, beside its agent: the second witness of a node whose agent is
    silent and whose ranks have no peer on other nodes (``opsd.policy.detection``)."""

    def node_ready(self, node: str) -> bool | None:
        """True: the node is up and the run's processes on it run; False: it is down, or they are gone or stopped;
        None: the backend cannot tell. Cheap enough for a detection pass, called for silent nodes only."""
        ...


@runtime_checkable
class Attaching(Protocol):
    """A backend that can make a job already on its machines a run (``opsd runs attach TARGET``): on Kubernetes, a
    JobSet without the ``opsd.io/run`` annotation."""

    def attach_spec(self, target: str) -> tuple[str, RunSpec]:
        """The run's default name and its spec for ``target``, the job in the backend's own words (Kubernetes:
        ``NAMESPACE/JOBSET``); ``BodyError`` when it names none. Reads nothing: the backend finds the job at its
        next pass."""
        ...


@runtime_checkable
class SharedSpares(Protocol):
    """A backend whose spares are the cluster's, shared by its runs (Kubernetes: ``opsd.io/pool=spare``), not each
    run's own: the controller sizes that pool (``opsd spares``)."""

    shares_spares: bool


class Backend(Protocol):
    """The machine-level steps of a recovery (see the module's docstring for what each may assume)."""

    @property
    def name(self) -> str:
        """Its name in the registry (``local``, ``fake``, ...): recorded with the runs it starts."""
        ...

    def stop_ranks(
        self, run: str, request_id: str, group: int | None = None, launch: int | None = None
    ) -> Outcome[Stopped]:
        """Stop every rank of the run's current launch, or (``group``) of one replica group of a fault-tolerant run
        (the other groups go on). ``launch``: the group's launch the failure was seen in; a backend whose cluster
        relaunches a failed group on its own (JobSet's ``RestartJob``) stops that launch and leaves a newer one be,
        so that one failure makes one relaunch whichever acts first. Done: ``Stopped``: ``killed``, the ranks still
        running, and ``launch``, the launch stopped, where the backend names its launches (see ``relaunch``)."""
        ...

    def quarantine_node(self, run: str, node: str, reason: str, request_id: str) -> Outcome[NodeChanged]:
        """Take a failed node out of service: nothing of the run is scheduled there again until it is released."""
        ...

    def release_node(self, node: str, request_id: str) -> Outcome[NodeChanged]:
        """Put a quarantined node back in service (an operator's uncordon): it may be a spare again."""
        ...

    def promote_spare(self, run: str, spare: str, replaces: str, request_id: str) -> Outcome[NodeChanged]:
        """Make a spare node one of the run's: the next launch may place ranks there."""
        ...

    def relaunch(
        self,
        run: str,
        generation: int,
        nodes: Sequence[str],
        request_id: str,
        group: int | None = None,
        stopped: int | None = None,
    ) -> Outcome[Launched]:
        """Launch ``generation`` of the run's ranks on ``nodes`` (what still runs of an earlier one is stopped
        first); the ranks resume from their newest committed checkpoint. With ``group``: launch one replica group
        of a fault-tolerant run on ``nodes`` (the others run on; it heals from them, no checkpoint read). Done:
        ``Launched``: ``nodes``, ``resumed_from_step``, ``skipped`` (newer checkpoints that could not be resumed
        from, and why), and ``launch`` where the backend tells its ranks which launch they belong to
        (``OPSD_LAUNCH``: their reports carry it, and the controller takes the reports of that launch and no earlier
        one, whenever they come). ``stopped``: with ``group``, the group's launch its stop ended (its ``Stopped``
        result's): the relaunch is a later one."""
        ...

    def request_dump(self, run: str, trigger: str, request_id: str) -> Outcome[DumpReady]:
        """Get the ranks ready to write Flight Recorder dumps named ``trigger`` (the controller asks them through
        its policy and waits for the dumps). Done: ``DumpReady``: ``ranks``, the ranks still running, who can
        dump, or None: the controller's view of the run's ranks decides."""
        ...

    def inject(self, run: str, fault: Fault, request_id: str) -> Outcome[Injected]:
        """Inject a fault (tests, demos, game days). Done: ``Injected``, what was done, in words."""
        ...

    def resumed_from(self, run: str) -> int | None:
        """The checkpoint step the run's current launch resumed from, when the backend knows it."""
        ...
