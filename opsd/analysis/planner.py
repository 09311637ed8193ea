"""Parallelism and memory planner: what one GPU holds and sends for a transformer on a parallel mesh.

Pure: frozen dataclasses in, a ``Plan`` out; no I/O. The formulas and their assumptions are in docs/planner.md.

- Model state (Rajbhandari et al., "ZeRO", SC 2020): mixed-precision Adam keeps 2 + 2 + 12 = 16 bytes per
  parameter; ZeRO-1 shards the optimizer state, ZeRO-2 also the gradients, ZeRO-3 / FSDP also the weights, over the
  sharding group (``dp_shard`` x ``cp`` x ``ep`` for dense parameters, ``dp_shard`` x ``cp`` for experts).
- Activations (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022):
  s b h (34/t + 5 a s / (h t)) bytes per layer and micro-batch with tensor and sequence parallelism; 1F1B keeps
  min(p, m) micro-batches in flight on the first pipeline stage.
- Pipeline bubble (p - 1) / (m + p - 1); communication in bytes sent per GPU per step, ring algorithms.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from rich.table import Table

from opsd.policy.pipeline import bubble_ratio as bubble_ratio  # the formula, next to the measured bubble
from opsd.protocol.mesh import MeshSpec

MESH_DIMS: tuple[str, ...] = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")
SHARDING_MODES: tuple[str, ...] = ("none", "zero1", "zero2", "zero3", "fsdp")
CHECKPOINTING_MODES: tuple[str, ...] = ("none", "selective", "full")
ACTIVATION_BYTES = 2  # bf16/fp16 activations, as Korthikanti et al. assume


def _positive(prefix: str, obj: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{prefix}.{name} must be an integer, got {value!r}")
        if value < 1:
            raise ValueError(f"{prefix}.{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes of model state per parameter; the default is mixed-precision Adam (ZeRO paper): 2 + 2 + 12."""

    weight_bytes: float = 2.0  # bf16/fp16 working weights
    gradient_bytes: float = 2.0
    optimizer_bytes: float = 12.0  # fp32 master weights + momentum + variance

    def __post_init__(self) -> None:
        if not self.weight_bytes > 0:
            raise ValueError(f"bytes_per_param.weight_bytes must be > 0, got {self.weight_bytes!r}")
        for name in ("gradient_bytes", "optimizer_bytes"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"bytes_per_param.{name} must be >= 0, got {getattr(self, name)!r}")

    @property
    def total_bytes(self) -> float:
        return self.weight_bytes + self.gradient_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-style decoder: GQA attention, SwiGLU MLP (3 matrices), RMSNorm, untied input and output embeddings.
    ``experts`` > 1 makes every MLP a mixture of that many experts, ``experts_per_token`` of them active."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    experts: int = 1
    experts_per_token: int = 1

    def __post_init__(self) -> None:
        _positive("model", self, ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "experts"))
        _positive("model", self, ("experts_per_token",))
        if self.hidden % self.heads:
            raise ValueError(f"model.hidden ({self.hidden}) must be a multiple of model.heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"model.heads ({self.heads}) must be a multiple of model.kv_heads ({self.kv_heads})")
        if self.experts_per_token > self.experts:
            raise ValueError("model.experts_per_token must be <= model.experts")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


#: Llama 3 (Dubey et al. 2024, Table 3).
PRESETS: Mapping[str, ModelSpec] = MappingProxyType(
    {
        "llama3-8b": ModelSpec("llama3-8b", 32, 4096, 32, 8, 14336, 128256),
        "llama3-70b": ModelSpec("llama3-70b", 80, 8192, 64, 8, 28672, 128256),
        "llama3-405b": ModelSpec("llama3-405b", 126, 16384, 128, 8, 53248, 128256),
    }
)


def preset(name: str) -> ModelSpec:
    if name not in PRESETS:
        raise ValueError(f"model: unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]


def parse_model(text: str) -> ModelSpec:
    """A preset's name, or ``layers=32,hidden=4096,heads=32,kv_heads=8,ffn_hidden=14336,vocab=128256`` (plus
    ``experts=`` and ``experts_per_token=`` for a mixture of experts)."""
    if "=" not in text:
        return preset(text.strip())
    fields: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in ModelSpec.__dataclass_fields__ or key == "name":
            raise ValueError(f"model: unknown field {key!r} in {text!r}")
        try:
            fields[key] = int(value)
        except ValueError:
            raise ValueError(f"model: {key} must be a whole number, not {value!r}") from None
    missing = [f for f in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab") if f not in fields]
    if missing:
        raise ValueError(f"model: missing {', '.join(missing)} in {text!r}")
    return ModelSpec("custom", **fields)


def _dense_layer_params(model: ModelSpec) -> int:
    """Attention (q, o: h x h; k, v: h x kv_heads*head_dim), two norms, and the dense MLP or the router."""
    attention = 2 * model.hidden**2 + 2 * model.hidden * model.kv_heads * model.head_dim
    mlp = 3 * model.hidden * model.ffn_hidden if model.experts == 1 else model.hidden * model.experts
    return attention + mlp + 2 * model.hidden


def _expert_layer_params(model: ModelSpec) -> int:
    return 3 * model.hidden * model.ffn_hidden * model.experts if model.experts > 1 else 0


def parameter_count(model: ModelSpec) -> int:
    """All parameters: layers, input embedding, output projection and the final norm."""
    per_layer = _dense_layer_params(model) + _expert_layer_params(model)
    return model.layers * per_layer + 2 * model.vocab * model.hidden + model.hidden


Mesh = MeshSpec  # the reference trainer's layout (pure): the same names and checks as ``examples.train --mesh``


def parse_mesh(text: str) -> Mesh:
    """``"dp_shard=128,tp=8,pp=16"``: unnamed dimensions are 1."""
    return MeshSpec.parse(text)


def mesh_text(mesh: Mesh) -> str:
    return ",".join(f"{name}={getattr(mesh, name)}" for name in MESH_DIMS)


@dataclass(frozen=True)
class PlanOptions:
    sharding: str = "zero3"  # none (DDP), zero1, zero2, zero3 = fsdp
    micro_batch_size: int = 1  # sequences per micro-batch
    seq_len: int = 8192
    micro_batches: int = 1  # per step (gradient accumulation, pipeline micro-batches)
    checkpointing: str = "selective"  # none, selective (also: flash attention), full
    sequence_parallel: bool = True  # with tp > 1
    gpu_memory_bytes: float = 80e9
    bytes_per_param: BytesPerParam = BytesPerParam()

    def __post_init__(self) -> None:
        _positive("plan", self, ("micro_batch_size", "seq_len", "micro_batches"))
        if not self.gpu_memory_bytes > 0:
            raise ValueError(f"plan.gpu_memory_bytes must be > 0, got {self.gpu_memory_bytes!r}")
        if self.sharding not in SHARDING_MODES:
            raise ValueError(f"plan.sharding must be one of {', '.join(SHARDING_MODES)}, got {self.sharding!r}")
        if self.checkpointing not in CHECKPOINTING_MODES:
            raise ValueError(
                f"plan.checkpointing must be one of {', '.join(CHECKPOINTING_MODES)}, got {self.checkpointing!r}"
            )


def check_layout(model: ModelSpec, mesh: Mesh, options: PlanOptions) -> None:
    """Raise ValueError naming the first degree that cannot split the model or the sequence."""
    t = mesh.tp
    for name in ("heads", "hidden", "ffn_hidden"):
        if getattr(model, name) % t:
            raise ValueError(f"mesh.tp ({t}) must divide model.{name} ({getattr(model, name)})")
    if model.kv_heads % t and t % model.kv_heads:
        raise ValueError(f"mesh.tp ({t}) and model.kv_heads ({model.kv_heads}) must divide one another")
    if mesh.pp > model.layers:
        raise ValueError(f"mesh.pp ({mesh.pp}) must be <= model.layers ({model.layers})")
    if model.experts > 1 and model.experts % mesh.ep:
        raise ValueError(f"mesh.ep ({mesh.ep}) must divide model.experts ({model.experts})")
    split = mesh.cp * (t if options.sequence_parallel else 1)
    if options.seq_len % split:
        raise ValueError(f"plan.seq_len ({options.seq_len}) must be a multiple of cp x tp ({split})")


@dataclass(frozen=True)
class Memory:
    weights_bytes: float
    gradients_bytes: float
    optimizer_bytes: float
    activations_bytes: float = 0.0

    @property
    def total_bytes(self) -> float:
        return self.weights_bytes + self.gradients_bytes + self.optimizer_bytes + self.activations_bytes

    def __add__(self, other: Memory) -> Memory:
        return Memory(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)))


def model_state_bytes(params: float, sharding: str, shard_size: int, bpp: BytesPerParam) -> Memory:
    """Model state of ``params`` parameters on one GPU of a sharding group of ``shard_size`` (ZeRO paper, Fig. 1)."""
    if sharding not in SHARDING_MODES or shard_size < 1:
        raise ValueError(f"sharding must be one of {', '.join(SHARDING_MODES)} and shard_size >= 1")
    stage = {"none": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}[sharding]
    n = shard_size
    return Memory(
        params * bpp.weight_bytes / (n if stage >= 3 else 1),
        params * bpp.gradient_bytes / (n if stage >= 2 else 1),
        params * bpp.optimizer_bytes / (n if stage >= 1 else 1),
    )


def layers_per_stage(model: ModelSpec, mesh: Mesh) -> int:
    """Layers on the most loaded pipeline stage."""
    return math.ceil(model.layers / mesh.pp)


def stage_params(model: ModelSpec, mesh: Mesh) -> tuple[float, float]:
    """(dense, expert) parameters on one GPU of the most loaded stage, after tp, pp and ep, before ZeRO/FSDP.
    A stage holds one embedding (input or output) when pp > 1, both when pp = 1."""
    layers = layers_per_stage(model, mesh)
    embeddings = model.vocab * model.hidden * (2 if mesh.pp == 1 else 1) + model.hidden
    dense = (layers * _dense_layer_params(model) + embeddings) / mesh.tp
    return dense, layers * _expert_layer_params(model) / (mesh.tp * mesh.ep)


def layer_activation_bytes(model: ModelSpec, mesh: Mesh, options: PlanOptions) -> float:
    """Activations one layer keeps for the backward pass of one micro-batch (Korthikanti et al. 2022, Table 2)."""
    s, b, h, a, t = options.seq_len / mesh.cp, options.micro_batch_size, model.hidden, model.heads, mesh.tp
    sp = options.sequence_parallel or t == 1
    if options.checkpointing == "full":
        return 2 * s * b * h / (t if sp else 1)  # the layer's input only
    mlp_extra = 19 * (model.experts_per_token - 1)  # every further active expert keeps its own MLP activations
    linear = (34 + mlp_extra) / t if sp else 10 + (24 + mlp_extra) / t
    if options.checkpointing == "selective":
        return s * b * h * linear
    return s * b * h * linear + 5 * a * s * options.seq_len * b / t  # local queries x all keys


def activation_bytes(model: ModelSpec, mesh: Mesh, options: PlanOptions) -> float:
    """The larger of the first stage (min(p, m) micro-batches in flight) and the last (one, plus the logits)."""
    layers, t = layers_per_stage(model, mesh), mesh.tp
    s, b = options.seq_len / mesh.cp, options.micro_batch_size
    per_layer = layer_activation_bytes(model, mesh, options)
    logits = 4 * s * b * (model.hidden + model.vocab) / t  # output layer and cross entropy, fp32
    first = min(mesh.pp, options.micro_batches) * layers * per_layer + (logits if mesh.pp == 1 else 0.0)
    last = layers * per_layer + logits
    working = 0.0
    if options.checkpointing == "full":  # one layer's activations, rebuilt during its backward
        working = layer_activation_bytes(model, mesh, dataclasses.replace(options, checkpointing="none"))
    return max(first, last) + working


def _ring(n: int) -> float:
    """Share of a buffer each GPU sends in a ring all-gather or reduce-scatter over n GPUs."""
    return (n - 1) / n


def dp_comm_bytes(
    params: float, sharding: str, shard: int, replicate: int, micro_batches: int, bpp: BytesPerParam
) -> float:
    """Bytes one GPU sends per step to synchronise ``params`` parameters over the data-parallel group."""
    if sharding not in SHARDING_MODES or min(shard, replicate, micro_batches) < 1:
        raise ValueError(f"sharding must be one of {', '.join(SHARDING_MODES)}; shard, replicate, micro_batches >= 1")
    g, w, m = bpp.gradient_bytes, bpp.weight_bytes, micro_batches
    if sharding == "none":
        return 2 * _ring(shard * replicate) * g * params  # one all-reduce of the gradients
    per_buffer = {"zero1": g + w, "zero2": m * g + w, "zero3": m * (2 * w + g), "fsdp": m * (2 * w + g)}[sharding]
    return _ring(shard) * per_buffer * params + 2 * _ring(replicate) * g * params / shard


@dataclass(frozen=True)
class Comm:
    """Bytes one GPU sends per step, per mesh dimension (``dp`` covers dp_replicate, dp_shard and their cp/ep)."""

    dp_bytes: float
    tp_bytes: float
    pp_bytes: float
    cp_bytes: float
    ep_bytes: float


def comm_bytes(model: ModelSpec, mesh: Mesh, options: PlanOptions) -> Comm:
    """Bytes one GPU of the most loaded stage sends per step in each dimension (formulas: docs/planner.md)."""
    s, b, h, m = options.seq_len / mesh.cp, options.micro_batch_size, model.hidden, options.micro_batches
    t, layers, full = mesh.tp, layers_per_stage(model, mesh) * m, options.checkpointing == "full"
    bpp, dense, expert = options.bytes_per_param, *stage_params(model, mesh)
    dp = dp_comm_bytes(dense, options.sharding, mesh.fsdp_size, mesh.dp_replicate, m, bpp)
    if expert:
        dp += dp_comm_bytes(expert, options.sharding, mesh.dp_shard * mesh.cp, mesh.dp_replicate, m, bpp)
    hidden_bytes = ACTIVATION_BYTES * s * b * h
    tp = (8 + 4 * full) * _ring(t) * hidden_bytes * layers  # 4 all-gathers/reduce-scatters per pass
    pp = 2 * m * hidden_bytes / t if mesh.pp > 1 else 0.0  # one activation out, one gradient back per micro-batch
    kv_heads = max(1, model.kv_heads // t)
    kv = 2 * ACTIVATION_BYTES * options.seq_len * b * kv_heads * model.head_dim  # K and V, whole sequence
    cp = (2 + full) * _ring(mesh.cp) * kv * layers
    ep = 0.0
    if model.experts > 1:
        ep = (4 + 2 * full) * _ring(mesh.ep) * hidden_bytes * model.experts_per_token / t * layers
    return Comm(dp, tp, pp, cp, ep)


@dataclass(frozen=True)
class Plan:
    model: ModelSpec
    mesh: Mesh
    options: PlanOptions
    parameters: int
    parameters_per_gpu: float  # after tp, pp and ep, before ZeRO/FSDP sharding
    layers_per_stage: int
    tokens_per_step: int
    memory: Memory
    bubble_ratio: float
    comm: Comm
    headroom_bytes: float  # GPU memory minus the total; negative when it does not fit

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0

    @property
    def verdict(self) -> str:
        gpu, total = _gb(self.options.gpu_memory_bytes), _gb(self.memory.total_bytes)
        if self.fits:
            return f"fits: {total} of {gpu} per GPU ({_gb(self.headroom_bytes)} free)"
        parts = {"weights": self.memory.weights_bytes, "gradients": self.memory.gradients_bytes}
        parts |= {"optimizer state": self.memory.optimizer_bytes, "activations": self.memory.activations_bytes}
        largest = max(parts, key=lambda k: parts[k])
        return (
            f"does not fit: {total} per GPU needed, {gpu} available, short by {_gb(-self.headroom_bytes)} "
            f"(largest part: {largest}, {_gb(parts[largest])})"
        )


def _gb(value: float) -> str:
    return f"{value / 1e9:.2f} GB"


def plan(model: ModelSpec, mesh: Mesh, options: PlanOptions) -> Plan:
    """Memory, bubble and communication of the most loaded GPU of ``mesh`` training ``model``."""
    check_layout(model, mesh, options)
    dense, expert = stage_params(model, mesh)
    bpp = options.bytes_per_param
    state = model_state_bytes(dense, options.sharding, mesh.fsdp_size, bpp)
    if expert:
        state += model_state_bytes(expert, options.sharding, mesh.dp_shard * mesh.cp, bpp)
    memory = dataclasses.replace(state, activations_bytes=activation_bytes(model, mesh, options))
    batch_shards = mesh.dp_replicate * mesh.dp_shard * mesh.ep
    return Plan(
        model=model,
        mesh=mesh,
        options=options,
        parameters=parameter_count(model),
        parameters_per_gpu=dense + expert,
        layers_per_stage=layers_per_stage(model, mesh),
        tokens_per_step=options.micro_batches * options.micro_batch_size * options.seq_len * batch_shards,
        memory=memory,
        bubble_ratio=bubble_ratio(mesh.pp, options.micro_batches),
        comm=comm_bytes(model, mesh, options),
        headroom_bytes=options.gpu_memory_bytes - memory.total_bytes,
    )


def plan_rows(p: Plan) -> list[tuple[str, str]]:
    """(quantity, value) rows, in the order both renderers show them."""
    o, mem = p.options, p.memory
    rows = [
        ("model", f"{p.model.name}: {p.parameters / 1e9:.2f} billion parameters"),
        ("mesh", f"{mesh_text(p.mesh)} ({p.mesh.world_size} GPUs)"),
        ("layout", f"{o.sharding}, checkpointing {o.checkpointing}, {p.layers_per_stage} layers per stage"),
        ("batch", f"{o.micro_batches} x {o.micro_batch_size} x {o.seq_len} tokens, {p.tokens_per_step} per step"),
        ("parameters per GPU", f"{p.parameters_per_gpu / 1e9:.3f} billion (before ZeRO/FSDP)"),
        ("weights", _gb(mem.weights_bytes)),
        ("gradients", _gb(mem.gradients_bytes)),
        ("optimizer state", _gb(mem.optimizer_bytes)),
        ("activations", _gb(mem.activations_bytes)),
        ("total per GPU", _gb(mem.total_bytes)),
        ("pipeline bubble", f"{p.bubble_ratio:.1%}"),
    ]
    rows += [
        (f"{f.name.removesuffix('_bytes')} sent per step", _gb(getattr(p.comm, f.name)))
        for f in dataclasses.fields(p.comm)
    ]
    return [*rows, ("verdict", p.verdict)]


def render_text(p: Plan) -> str:
    rows = plan_rows(p)
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name.ljust(width)}  {value}" for name, value in rows) + "\n"


def render_table(p: Plan) -> Table:
    table = Table(title=f"plan: {p.model.name} on {p.mesh.world_size} GPUs")
    table.add_column("quantity")
    table.add_column("value", style="bold")
    for name, value in plan_rows(p):
        table.add_row(name, value, style=None if name != "verdict" else "green" if p.fits else "red")
    return table


def plan_to_dict(p: Plan) -> dict[str, object]:
    """JSON-ready: the inputs, every figure in bytes or ratios, and the verdict."""
    out = dataclasses.asdict(p)
    out["mesh"] |= {"world_size": p.mesh.world_size}
    out["memory"]["total_bytes"] = p.memory.total_bytes
    return out | {"fits": p.fits, "verdict": p.verdict}
