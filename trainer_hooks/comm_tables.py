"""The collectives' tables, free of torch: the parallel dimensions and phases a collective is counted under, the
op label of each ``torch.distributed`` function, functional op and c10d ``OpType``, and the per-step sums
(``StepComms``) that ``trainer_hooks.collectives``' tracer fills and ``trainer_hooks.monitor`` reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from opsd.protocol.wire import PHASES as PHASES

FORWARD, BACKWARD, OPTIMIZER, OTHER = PHASES  # the wire's phases
DIMENSIONS = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", OTHER)
#: (dimension, op, phase): what a collective is counted under (a phase of ``PHASES``)
Key = tuple[str, str, str]
# the arguments naming the peer of a point-to-point function: a global rank, or a rank in the group
PEER_ARGUMENTS = {
    "send": ("dst", "group_dst"),
    "recv": ("src", "group_src"),
    "isend": ("dst", "group_dst"),
    "irecv": ("src", "group_src"),
}

# torch.distributed function -> (op label, the argument whose bytes count, always asynchronous)
DIST_FUNCTIONS: dict[str, tuple[str, str, bool]] = {
    "all_reduce": ("all_reduce", "tensor", False),
    "all_gather_single": ("all_gather", "output_tensor", False),
    "all_gather_into_tensor": ("all_gather", "output_tensor", False),
    "all_gather": ("all_gather", "tensor_list", False),
    "reduce_scatter_single": ("reduce_scatter", "input", False),
    "reduce_scatter_tensor": ("reduce_scatter", "input", False),
    "all_to_all_single": ("all_to_all", "input", False),
    "broadcast": ("broadcast", "tensor", False),
    "send": ("send", "tensor", False),
    "recv": ("recv", "tensor", False),
    "isend": ("send", "tensor", True),
    "irecv": ("recv", "tensor", True),
}
# ``P2POp`` and ``batch_isend_irecv`` compare ``op`` with these by identity, against the names in
# ``distributed_c10d``: they are replaced there as well as in ``torch.distributed``.
IDENTITY_CHECKED = ("isend", "irecv")
# functional op -> (op label, index of the tensor argument, index of the group-name argument)
# Bytes are those of the full buffer, as in nccl-tests: all-gather output, reduce-scatter input, the tensor of
# all-reduce / broadcast / send / recv, all-to-all input. A functional all-gather names its input and the group
# size: its output is input x group size.
FUNCTIONAL_OPS: dict[str, tuple[str, int, int]] = {
    "all_reduce": ("all_reduce", 0, 2),
    "all_gather_into_tensor": ("all_gather", 0, 2),
    "reduce_scatter_tensor": ("reduce_scatter", 0, 3),
    "all_to_all_single": ("all_to_all", 0, 3),
    "broadcast": ("broadcast", 0, 2),
}
FUNCTIONAL_GROUP_SIZE_INDEX = {"all_gather_into_tensor": 1}


# c10d OpType name (as the on-completion hook reports it) -> op label
OP_TYPES: dict[str, str] = {
    "ALLREDUCE": "all_reduce",
    "ALLREDUCE_COALESCED": "all_reduce",
    "ALLGATHER": "all_gather",
    "_ALLGATHER_BASE": "all_gather",
    "ALLGATHER_COALESCED": "all_gather",
    "REDUCE_SCATTER": "reduce_scatter",
    "_REDUCE_SCATTER_BASE": "reduce_scatter",
    "REDUCE_SCATTER_TENSOR_COALESCED": "reduce_scatter",
    "ALLTOALL": "all_to_all",
    "ALLTOALL_BASE": "all_to_all",
    "BROADCAST": "broadcast",
    "SEND": "send",
    "RECV": "recv",
    "RECVANYSOURCE": "recv",
}


def op_label(op_type: Any) -> str:
    """The op label of a c10d ``OpType`` (``OpType.ALLREDUCE`` -> ``all_reduce``); unknown types -> ``other``."""
    name = getattr(op_type, "name", str(op_type)).rsplit(".", 1)[-1]
    return OP_TYPES.get(name, OTHER)


@dataclass
class OpStats:
    count: int = 0
    bytes: int = 0
    seconds: float = 0.0
    host_timed: bool = False  # (some of) its seconds timed on the host where the GPU's were refused


#: the pipeline's point-to-point ops: the waits on them are a stage's bubble
PIPELINE_DIMENSION, PIPELINE_OPS = "pp", ("send", "recv")


def is_pipeline_transfer(key: Key | None) -> bool:
    """Whether ``key`` is a send or receive between pipeline stages."""
    return key is not None and key[0] == PIPELINE_DIMENSION and key[1] in PIPELINE_OPS


@dataclass
class StepComms:
    """Collectives of one step: per (dimension, op, phase) counts, bytes and issue-to-completion seconds; exposed
    seconds; the seconds the training thread waited on the pipeline's sends and receives (its bubble: on a host-timed
    group the waits, on one timed by its completion hook the transfers' durations), and how many it issued.
    ``gpu_pending``: the collectives of the step whose duration the GPU has not reported yet (their completion hook
    adds it here, to the step that issued them, whenever it fires: the step's figures are final at 0)."""

    phases: dict[Key, OpStats] = field(default_factory=dict)
    exposed_s: float = 0.0
    pipeline_wait_s: float = 0.0
    pipeline_transfers: int = 0
    gpu_pending: int = 0

    @property
    def ops(self) -> dict[tuple[str, str], OpStats]:
        """Per (dimension, op), over the phases."""
        out: dict[tuple[str, str], OpStats] = {}
        for (dim, op, _), s in self.phases.items():
            acc = out.setdefault((dim, op), OpStats())
            acc.count += s.count
            acc.bytes += s.bytes
            acc.seconds += s.seconds
        return out

    @property
    def total_s(self) -> float:
        return sum(s.seconds for s in self.phases.values())

    def by_dimension(self) -> dict[str, OpStats]:
        out: dict[str, OpStats] = {}
        for (dim, _), s in self.ops.items():
            acc = out.setdefault(dim, OpStats())
            acc.count += s.count
            acc.bytes += s.bytes
            acc.seconds += s.seconds
        return out


class GroupInfo:
    """What the tracer knows of a process group, looked up once per group: its name, the dimension it is labelled
    with, whether its completion hook reports the durations of its collectives, and whether that hook was
    refused."""

    __slots__ = ("dim", "fell_back", "gpu_timed", "name")

    def __init__(self, name: str, dim: str, gpu_timed: bool, fell_back: bool = False) -> None:
        self.name = name
        self.dim = dim
        self.gpu_timed = gpu_timed
        self.fell_back = fell_back  # its completion hook was refused: timed on the host where the GPU's are meant


@dataclass(frozen=True)
class Blocked:
    """The training thread is waiting on a collective: its dimension and op, since (``perf_counter``), how long."""

    dim: str
    op: str
    since: float
    waited_s: float


def add_batch_duration(step: StepComms, keys: list[Key], seconds: float) -> None:
    """A batch of point-to-point transfers took ``seconds`` on the GPU: shared among its transfers, and (on the
    pipeline's group) the stage's wait, once."""
    share = seconds / len(keys)
    for key in keys:
        stats = step.phases.get(key)
        if stats is None:
            stats = step.phases[key] = OpStats()
        stats.seconds += share
    if any(is_pipeline_transfer(key) for key in keys):
        step.pipeline_wait_s += seconds
    step.gpu_pending = max(step.gpu_pending - len(keys), 0)
