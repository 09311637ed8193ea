"""The controller's answers to the API's reads, typed: a run's status, the spare pools, a run's checkpoints and its
checkpoint cadence (docs/controller.md, "API"). The controller's views build them, the API sends them (each is
documented in ``/openapi.json``), and the CLI and the post-mortem decode the same structs (``decode_answer``).

Fields added after an answer's first version have defaults, so that a newer CLI reads an older controller; fields a
newer controller adds are ignored by an older CLI. Numbers are checked on decoding: NaN, the infinities and negative
seconds are refused, naming the field's path.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec
from msgspec import Struct

from opsd.errors import PermanentError
from opsd.protocol.fields import FINITE_BOUNDS, Finite
from opsd.protocol.fields import FiniteSeconds as Seconds

A = TypeVar("A")


# -- a run's status (GET /v1/runs/{run}) ---------------------------------------------------------------------------
class NodeEntry(Struct, frozen=True, kw_only=True):
    """One node of a run and its role (``NodeRole``'s value), and why it is cordoned."""

    name: str = "?"
    role: str | None = None
    reason: str = ""


class PlannedCadence(Struct, frozen=True, kw_only=True):
    """The checkpoint cadence published to the run's ranks: every ``every_steps`` steps from ``from_step``."""

    every_steps: int
    from_step: int
    reason: str = ""


class Straggler(Struct, frozen=True, kw_only=True):
    rank: int
    node: str
    slowdown_ratio: Finite


class AgentDown(Struct, frozen=True, kw_only=True):
    """A node whose agent is silent while its ranks train on (nothing is recovered)."""

    node: str
    detail: str = ""


class Maintenance(Struct, frozen=True, kw_only=True):
    """Recoveries held by an operator (``opsd maintenance``): of every run, or of this one."""

    every_run: bool
    reason: str
    since_s: Finite


class MaintenanceWindow(Struct, frozen=True, kw_only=True):
    """A maintenance window in force (``opsd maintenance start``, ``GET /v1/maintenance``): it holds the recoveries
    of ``run``, or of every run (None)."""

    run: str | None
    reason: str
    since_s: Finite


class WindowEnded(Struct, frozen=True, kw_only=True):
    """``opsd maintenance stop``: the window of ``run`` (None: every run's) ended, or none held it (``ended``
    False)."""

    run: str | None
    ended: bool


class PipelineBubble(Struct, frozen=True, kw_only=True):
    """A run's pipeline bubble: measured (the mean of its ranks' last steps, and per stage), the theory of its
    schedule, and the margin the alert allows (docs/pipeline.md)."""

    bubble_ratio: Finite
    theoretical_ratio: Finite | None = None
    margin_ratio: Finite | None = None
    over_theory: bool = False
    schedule: str = ""
    stages: int | None = None
    microbatches: int | None = None
    stage_ratios: dict[str, Finite] = {}


class ReplicaGroups(Struct, frozen=True, kw_only=True):
    """A fault-tolerant run's replica groups: how many, the quorum's minimum, those in service and those out, the
    groups in the newest quorum its ranks reported, and the steps each group missed while out."""

    groups: int
    min_replicas: int
    in_service: tuple[int, ...] = ()
    out: tuple[int, ...] = ()
    quorum_replica_groups: int | None = None
    missed_steps: dict[str, int] = {}


class LastMeasured(Struct, frozen=True, kw_only=True):
    """The last sample of the job's MFU and tokens/s a launch recorded, and the pipeline bubble of the last launch
    that had one (``pipeline_launch``)."""

    launch: int | None = None
    mfu_ratio: Finite | None = None
    tokens_per_s: Finite | None = None
    at_unix_s: Finite | None = None
    pipeline: PipelineBubble | None = None
    pipeline_launch: int | None = None


class RunAverage(Struct, frozen=True, kw_only=True):
    """The averages over every sample taken while the ranks progressed, over every launch."""

    mfu_ratio: Finite | None = None
    tokens_per_s: Finite | None = None
    samples: int = 0
    bubble_ratio: Finite | None = None


class RunStatus(Struct, frozen=True, kw_only=True):
    """A run's state, step, MFU, tokens/s, ETTR and badput, cadence, nodes, spares, stragglers, the nodes whose
    agent is down while their ranks train, the maintenance hold, its pipeline and replica groups, and what its
    launches measured (live figures are 0 when no rank reports: ``last_measured`` then)."""

    run: str = ""
    state: str = ""
    generation: int = 0
    step: int = 0
    ranks: int = 0
    mfu_ratio: Finite = 0.0
    tokens_per_s: Finite = 0.0
    ettr: Finite | None = None
    badput_s: dict[str, Seconds] = {}
    mtbf_s: Finite | None = None
    cadence: PlannedCadence | None = None
    nodes: tuple[NodeEntry, ...] = ()
    spares_available: int = 0
    stragglers: tuple[Straggler, ...] = ()
    agents_down: tuple[AgentDown, ...] = ()
    maintenance: Maintenance | None = None
    open_incidents: int = 0
    pipeline: PipelineBubble | None = None
    replicas: ReplicaGroups | None = None
    last_measured: LastMeasured | None = None
    run_average: RunAverage | None = None


# -- the spare pools (GET /v1/spares) ------------------------------------------------------------------------------
class PoolNode(Struct, frozen=True, kw_only=True):
    """A spare and its health (``healthy``, ``unknown``, ``faulty``, ``unreachable``) and why."""

    name: str
    domain: str = ""
    health: str
    why: str = ""


class Cordoned(Struct, frozen=True, kw_only=True):
    name: str
    reason: str = ""


class SharedPool(Struct, frozen=True, kw_only=True):
    """The cluster's spare pool (spares of no run), with its recommended size over every run still going."""

    active_nodes: int
    spares: tuple[PoolNode, ...] = ()
    available: int = 0
    recommended: int
    why: str = ""


class RunPool(SharedPool, frozen=True, kw_only=True):
    """A run's own spare pool, its recommended size and why, and its cordoned nodes."""

    run: str
    state: str = ""
    cordoned: tuple[Cordoned, ...] = ()


class SparePools(Struct, frozen=True, kw_only=True):
    runs: tuple[RunPool, ...] = ()
    shared: SharedPool | None = None


# -- a run's checkpoints (GET /v1/runs/{run}/checkpoints) ---------------------------------------------------------
class CheckpointEntry(Struct, frozen=True, kw_only=True):
    """One checkpoint: committed or torn (``problem``: why), its bytes, and from its manifest the commit time and
    the ranks' blocking and whole-save seconds."""

    step: int
    state: str = "unknown"
    problem: str | None = None
    bytes: int | None = None
    time_unix_s: Finite | None = None
    blocking_s: Seconds | None = None
    save_s: Seconds | None = None


class Checkpoints(Struct, frozen=True, kw_only=True):
    """A run's checkpoints, newest first (``url``: its store; None, with ``why``, when it has none)."""

    run: str
    url: str | None = None
    checkpoints: tuple[CheckpointEntry, ...] = ()
    why: str = ""


# -- a run's checkpoint cadence (GET /v1/runs/{run}/cadence) -------------------------------------------------------
class Prior(Struct, frozen=True, kw_only=True):
    """The prior of the node MTBF estimate: a node MTBF, worth so many node-hours."""

    node_mtbf_h: Finite | None = None
    node_hours: Finite | None = None


class CadencePlan(Struct, frozen=True, kw_only=True):
    every_steps: int
    from_step: int
    interval_s: Finite
    every_s: Finite | None = None  # its steps times the median step time
    mtbf_s: Finite


class PreviousCadence(Struct, frozen=True, kw_only=True):
    every_steps: int
    from_step: int


class Mtbf(Struct, frozen=True, kw_only=True):
    """The run's MTBF estimate and its inputs: the run's failures and node-hours on top of the prior."""

    mtbf_s: Finite | None = None
    node_mtbf_h: Finite | None = None
    failures: int | None = None
    node_hours: Finite | None = None
    nodes: int | None = None
    prior: Prior = Prior()


class CadenceView(Struct, frozen=True, kw_only=True):
    """The checkpoint cadence of a run and its inputs: the MTBF estimate (the run's failures and node-hours on top of
    the prior, over its ``nodes``), the checkpoint's cost, the step time, the interval by Young's and Daly's rules,
    and the cadence published (or ``why`` there is none yet)."""

    run: str
    step: int | None = None
    nodes: int = 0
    prior: Prior = Prior()
    failures: int = 0
    node_hours: Finite = 0.0
    node_mtbf_h: Finite
    mtbf_s: Finite | None = None
    checkpoint_cost_s: Finite | None = None
    step_s: Finite | None = None
    young_interval_s: Finite | None = None
    daly_interval_s: Finite | None = None
    cadence: CadencePlan | None = None
    previous: PreviousCadence | None = None
    why: str = ""

    def mtbf(self) -> Mtbf:
        """The MTBF estimate and its inputs (what the post-mortem takes of the cadence)."""
        return Mtbf(
            mtbf_s=self.mtbf_s,
            node_mtbf_h=self.node_mtbf_h,
            failures=self.failures,
            node_hours=self.node_hours,
            nodes=self.nodes,
            prior=self.prior,
        )


def decode_answer(raw: object, kind: type[A], what: str) -> A:
    """``raw`` (decoded JSON) as ``kind``; a ``PermanentError`` naming ``what`` and the path of a field that does
    not fit (``run status: Expected `int`, got `str` - at `$.step```)."""
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as exc:
        message = str(exc)
        for bound in FINITE_BOUNDS:  # the finite numbers' bounds, in words
            message = message.replace(bound, "finite `float`")
        raise PermanentError(f"{what}: {message}") from None
