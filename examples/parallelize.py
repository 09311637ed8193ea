"""Apply the reference trainer's parallelisms to the decoder: PP split, then TP, CP, EP, and FSDP/HSDP last.

Every rank builds the full model from the same seed and keeps its part, so the initial weights of every layout
are those of the single-process model; this is what makes the layouts comparable step by step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from examples.feed_forward import FeedForward
from examples.model import Transformer
from examples.moe import MoE
from opsd.protocol.mesh import DIM_NAMES, MeshSpec

log = logging.getLogger(__name__)

SCHEDULES: dict[str, type[PipelineScheduleSingle]] = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


@dataclass(frozen=True)
class Meshes:
    """The world mesh with every dimension (size-1 ones included), and the data-parallel meshes of FSDP:
    ``dense`` shards dense weights over ep x dp_shard x cp, ``expert`` shards expert weights over dp_shard x cp;
    both are 2D (dp_replicate first) for HSDP when dp_replicate > 1."""

    world: DeviceMesh
    dense: DeviceMesh
    expert: DeviceMesh


def build_mesh(spec: MeshSpec, device_type: str) -> Meshes:
    world = init_device_mesh(device_type, tuple(spec.degrees().values()), mesh_dim_names=DIM_NAMES)
    dense = world["dp_replicate", "ep", "dp_shard", "cp"]._flatten("dp_all")
    expert = world["dp_replicate", "dp_shard", "cp"]._flatten("dp_expert")
    if spec.dp_replicate > 1:
        dense = dense._unflatten(0, (spec.dp_replicate, spec.fsdp_size), ("dp_replicate", "fsdp"))
        expert = expert._unflatten(0, (spec.dp_replicate, spec.fsdp_size // spec.ep), ("dp_replicate", "efsdp"))
    return Meshes(world, dense, expert)


def mesh_coordinates(mesh: DeviceMesh) -> dict[str, int]:
    """This rank's coordinate along every named dimension."""
    coords = mesh.get_coordinate()
    assert coords is not None, "this rank is not in the mesh"
    return dict(zip(DIM_NAMES, coords, strict=True))


def batch_shard_index(spec: MeshSpec, coords: dict[str, int]) -> int:
    """Which slice of the global batch this rank trains on (ranks differing only in tp, pp or cp share one)."""
    return (coords["dp_replicate"] * spec.ep + coords["ep"]) * spec.dp_shard + coords["dp_shard"]


def stage_layers(n_layers: int, pp: int, stage: int) -> range:
    """Layers of pipeline stage ``stage``: contiguous, as even as possible, earlier stages one more if uneven."""
    base, extra = divmod(n_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the tokens of ``logits [b, s, V]``."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@dataclass
class ParallelModel:
    """This rank's part of the model, and how to run one step on it."""

    module: Transformer
    spec: MeshSpec
    mesh: DeviceMesh
    coords: dict[str, int]
    schedule: PipelineScheduleSingle | None
    local_tokens: int = 0  # tokens of the last local batch
    autocast_dtype: torch.dtype | None = None  # forward under autocast to this dtype (bf16 without FSDP)

    @property
    def is_first_stage(self) -> bool:
        return self.coords["pp"] == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords["pp"] == self.spec.pp - 1

    def expert_parameters(self) -> list[nn.Parameter]:
        return [p for m in self.module.modules() if isinstance(m, MoE) for p in m.experts.parameters()]

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of one local batch; the mean loss on ranks that hold the last stage, else None."""
        if self.autocast_dtype is None:
            return self._forward_backward(inputs, targets)
        with torch.autocast(inputs.device.type, dtype=self.autocast_dtype):
            return self._forward_backward(inputs, targets)

    def _forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        if self.schedule is None:
            loss = lm_loss(self.module(inputs), targets)
            loss.backward()
            result: torch.Tensor | None = loss.detach()
        else:
            losses: list[torch.Tensor] = []
            if self.is_first_stage and self.is_last_stage:
                self.schedule.step(inputs, target=targets, losses=losses)
            elif self.is_first_stage:
                self.schedule.step(inputs)
            elif self.is_last_stage:
                self.schedule.step(target=targets, losses=losses)
            else:
                self.schedule.step()
            result = torch.stack(losses).mean().detach() if self.is_last_stage else None
        if self.spec.ep > 1:
            # An expert's gradient sums the losses of all ep ranks whose tokens it saw, while its data-parallel
            # reduction averages over dp_shard x cp x dp_replicate only: divide by ep to get the global mean.
            for param in self.expert_parameters():
                if param.grad is not None:
                    param.grad.div_(self.spec.ep)
        return result


def parallelize(
    build: Callable[[], Transformer],
    spec: MeshSpec,
    meshes: Meshes,
    device: torch.device,
    *,
    microbatches: int,
    schedule: str = "1f1b",
    dtype: torch.dtype = torch.float32,
    shard_always: bool = False,
) -> ParallelModel:
    """Build the model with ``build`` (seeded by the caller) and apply every parallelism of ``spec``.

    ``dtype`` is the compute dtype (float32 or bfloat16); weights, gradients' reduction and the optimizer stay in
    float32. In bfloat16, FSDP2's mixed-precision policy casts the weights where the model is sharded (gathered in
    bf16, gradients reduced in fp32), and autocast runs the forward where it is not, or where some weights are
    left out of FSDP (the experts of a rank that has them alone).
    ``shard_always``: FSDP wraps the model even on a single data-parallel rank (a fault-tolerant replica group
    averages its gradients with the other groups in FSDP's all-reduce hook, ``examples.ft``)."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be float32 or bfloat16, not {dtype}")
    mesh = meshes.world
    coords = mesh_coordinates(mesh)
    model = build().to(device)
    _split_pipeline(model, spec.pp, coords["pp"])
    if spec.tp > 1:
        _apply_tensor_parallel(model, mesh["tp"])
    if spec.cp > 1:
        _apply_context_parallel(model, mesh["cp"].get_group(), coords["cp"])
    if spec.ep > 1:
        for block in model.blocks():
            assert isinstance(block.feed_forward, MoE)
            block.feed_forward.shard_experts(mesh["ep"].get_group())
    autocast = None
    if spec.data_parallel_size > 1 or shard_always:
        mixed = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32 else None
        if _apply_fsdp(model, spec, meshes, mixed, shard_always=shard_always) and mixed is not None:
            autocast = dtype  # weights FSDP leaves alone stay float32: autocast casts their matmuls
    elif dtype != torch.float32:
        autocast = dtype
    pipeline = None
    if spec.pp > 1:
        stage = PipelineStage(model, coords["pp"], spec.pp, device, group=mesh["pp"].get_group())
        pipeline = SCHEDULES[schedule](stage, n_microbatches=microbatches, loss_fn=lm_loss)
    log.info("rank %d: layout %s, coordinates %s, %s", dist.get_rank(), spec, coords, dtype)
    return ParallelModel(model, spec, mesh, coords, pipeline, autocast_dtype=autocast)


def _split_pipeline(model: Transformer, pp: int, stage: int) -> None:
    keep = stage_layers(model.cfg.n_layers, pp, stage)
    for index in list(model.layers.keys()):
        if int(index) not in keep:
            del model.layers[index]
    if stage > 0:
        model.tok_embeddings = None
    if stage < pp - 1:
        model.norm = None
        model.output = None


def _apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Megatron-style: q/k/v and w1/w3 column-parallel, wo and w2 row-parallel. MoE layers stay replicated."""
    for block in model.blocks():
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
        }
        if isinstance(block.feed_forward, FeedForward):
            plan |= {
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(),
            }
        parallelize_module(block, tp_mesh, plan)


def _apply_context_parallel(model: Transformer, cp_group: dist.ProcessGroup, cp_rank: int) -> None:
    model.seq_offset = cp_rank * (model.cfg.seq_len // dist.get_world_size(cp_group))
    for block in model.blocks():
        block.attention.cp_group = cp_group
        if isinstance(block.feed_forward, MoE):
            block.feed_forward.cp_group = cp_group


def _apply_fsdp(
    model: Transformer,
    spec: MeshSpec,
    meshes: Meshes,
    mixed: MixedPrecisionPolicy | None,
    *,
    shard_always: bool = False,
) -> bool:
    """FSDP2 per block and at the root; HSDP (replicate x shard) when dp_replicate > 1; ``mixed``: the mixed
    precision policy (None: float32). Whether some weights were left out of FSDP.

    Expert weights differ across ep ranks, so they are sharded over their own data-parallel mesh
    (dp_replicate x dp_shard x cp), or left to this rank when that mesh is a single rank (unless ``shard_always``).
    """
    policy = mixed or MixedPrecisionPolicy()  # the default: no cast
    expert_dp = spec.dp_replicate * spec.dp_shard * spec.cp
    reshard = spec.pp == 1  # pipelining runs several micro-batches per step: keep weights gathered
    ignored: set[nn.Parameter] = set()
    for block in model.blocks():
        moe = block.feed_forward
        if spec.ep > 1 and isinstance(moe, MoE):
            if expert_dp > 1 or shard_always:
                fully_shard(moe.experts, mesh=meshes.expert, reshard_after_forward=reshard, mp_policy=policy)
            else:
                ignored |= set(moe.experts.parameters())
        fully_shard(
            block, mesh=meshes.dense, reshard_after_forward=reshard, ignored_params=ignored or None, mp_policy=policy
        )
    fully_shard(
        model, mesh=meshes.dense, reshard_after_forward=reshard, ignored_params=ignored or None, mp_policy=policy
    )
    return bool(ignored)
