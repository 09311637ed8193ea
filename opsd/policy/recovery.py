"""The recovery plan: which steps a failure needs, in which order, and what to do when no spare is left.

Pure: a failure in, a list of steps out. The controller's executor (``opsd.controller.recovery``) records each
step under its request id before carrying it out, and skips the ones already done, so the plan of an incident must
come out the same every time it is made (after a controller restart too): the steps, their order, and so their
request ids depend on the failure's kind alone. Their arguments are recorded with the first attempt and the
recorded ones are what a repeat uses.

- a graceful restart (an operator's ``opsd restart``) first asks the ranks for a checkpoint, at a step far enough
  ahead that every rank has heard of it (``checkpoint``);
- a hang or a collective timeout first asks the ranks for their Flight Recorder dumps, the post-mortem's evidence
  (``dump``);
- a failure that calls for a swap (a node lost, a fatal XID: ``Failure.swap``) quarantines the node
  (``cordon``) and promotes a spare in its place (``take_spare``), before anything is stopped: on a cluster, the
  stop is what makes the job restart, and its new pods must find the failed node closed and the spare open;
- so does a hang whose dumps blame a node that hung before (``Quarantine``: ``hang_strikes`` within a window reach
  a threshold): that plan is made again once the ``dump`` step is done, from what it recorded, so it too comes out
  the same at every attempt;
- every recovery stops the ranks of the failed launch (``stop``);
- every recovery ends by relaunching the ranks, who resume from the newest committed checkpoint (``launch``).

With no spare left, the run waits for one (a node uncordoned or added) or, when its spec allows it, shrinks: it
relaunches on the nodes it has left, down to ``min_nodes``. A run that waits has its ranks stopped first: the plan's
``stop`` is carried out ahead of its turn, under its own request id (so the recovery skips it when it goes on), and
nothing of the run holds a GPU or trains on the failed node meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from opsd.policy.detection import Failure, FailureKind
from opsd.protocol.states import ActionKind
from opsd.protocol.steps import CheckpointStep, CordonStep, DumpStep, LaunchStep, Step, StopStep, TakeSpareStep

#: failures whose evidence is the ranks' Flight Recorder dumps
DUMP_KINDS = frozenset({FailureKind.HANG, FailureKind.COLLECTIVE_TIMEOUT})


@dataclass(frozen=True)
class Quarantine:
    """A node to take out of service although the failure alone does not call for it (a repeated hang)."""

    node: str
    reason: str


def plan_recovery(
    failure: Failure,
    *,
    incident_id: int,
    generation: int,
    checkpoint_at_step: int | None,
    quarantine: Quarantine | None = None,
    group: int | None = None,
) -> list[Step]:
    """The steps that recover from ``failure`` (incident ``incident_id``), the ranks being at launch ``generation``;
    ``checkpoint_at_step``: the step a graceful restart's checkpoint is asked for (None: the ranks do not progress,
    the checkpoint is skipped); ``quarantine``: a node to swap all the same (a hang's dumps blamed it again);
    ``group``: the replica group the recovery is confined to (``opsd.policy.replicas.recovery_scope``; None: the
    whole job), which its ``stop`` and ``launch`` name (``generation`` is then that group's launch)."""
    steps: list[Step] = []
    if failure.kind is FailureKind.MANUAL_RESTART:
        steps.append(CheckpointStep(at_step=checkpoint_at_step))
    if failure.kind in DUMP_KINDS:
        steps.append(DumpStep(trigger=dump_trigger(incident_id)))
    if failure.swap:  # before the stop: nothing of the run may start on the failed node again
        steps.append(CordonStep(node=failure.node, reason=failure.detail))
        steps.append(TakeSpareStep(failed=failure.node))
    elif quarantine is not None:
        steps.append(CordonStep(node=quarantine.node, reason=quarantine.reason))
        steps.append(TakeSpareStep(failed=quarantine.node))
    steps.append(StopStep(generation=generation, group=group))
    steps.append(LaunchStep(after_generation=generation, group=group))
    return steps


def request_id(incident_id: int, seq: int, kind: ActionKind) -> str:
    """The request id of step ``seq`` of an incident's plan: the same at every attempt."""
    return f"incident-{incident_id}-{seq}-{kind.value}"


def dump_trigger(incident_id: int) -> str:
    """The name under which the ranks' Flight Recorder dumps of an incident are kept."""
    return f"incident-{incident_id}"


class OnNoSpare(StrEnum):
    WAIT = "wait"  # until a node is uncordoned or added
    SHRINK = "shrink"  # relaunch on the nodes left, down to min_nodes


def shrinks_without_spare(on_no_spare: OnNoSpare, nodes_left: int, min_nodes: int) -> bool:
    """A swap found no spare: whether the run shrinks (it allows it and has ``min_nodes`` left) rather than waits."""
    return on_no_spare is OnNoSpare.SHRINK and nodes_left >= min_nodes


def hang_strikes(node: str, hangs: Sequence[tuple[str, float]], now_s: float, window_s: float) -> int:
    """How many of ``hangs`` (the node each was blamed on, when it was detected) blamed ``node`` within the last
    ``window_s``."""
    return sum(1 for blamed, detected_s in hangs if blamed == node and now_s - window_s <= detected_s <= now_s)


def quarantine_after_hangs(strikes: int, threshold: int) -> bool:
    """Whether a node blamed for ``strikes`` hangs is swapped like a failed one (``threshold`` 0: never)."""
    return threshold > 0 and strikes >= threshold


def fails_at_start(unresumed_failures: int, barren_launches: int) -> bool:
    """Whether a run's job fails at start: ``unresumed_failures`` failures in a row, none of whose relaunches made a
    step, and at least ``barren_launches`` of them (0: never judged so). A recovery cannot help such a job (a bad
    image, a config error, a data path that is not there): launching it again would only spend the cluster, and a
    JobSet's own ``maxRestarts`` does not count the restarts opsd's evictions make."""
    return barren_launches > 0 and unresumed_failures >= barren_launches
