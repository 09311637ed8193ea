"""The parameters that enter matmuls in one forward pass, counted by tracing that forward on the ``meta`` device.

``count_matmul_params`` runs the module's forward once with every parameter, buffer and input replaced by a
``meta`` tensor of the same shape and dtype (no memory, no compute, the module's own tensors untouched) under a
``TorchDispatchMode`` that sees every aten matmul (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``mv``, ``linear``,
...). A matmul operand that is a parameter, or a view or copy of one (a transpose, a slice of stacked weights, a
dtype cast), is attributed to that parameter, whichever layer or function issued the matmul: ``nn.Linear``,
``F.linear`` on a bare ``nn.Parameter``, ``torch.matmul``, the fused query/key/value in-projection of
``nn.MultiheadAttention``, an output projection tied to the embedding.

A parameter counts its elements once per matmul it enters (a weight applied twice in a forward counts twice, as
its FLOPs are done twice; an embedding table counts only if it is also a matmul operand, e.g. a tied output
projection; a weight never used counts 0). A matmul whose two operands both come from parameters is not counted:
no token goes through it. Routed experts (``expert_param_filter``) are counted whole, whatever the meta forward
routed to them.

A submodule whose forward cannot run on the meta device (a data-dependent step such as the token counts of an MoE
router, a device check) is counted by the static rule instead, and the trace goes on with the forward of every
module of its class replaced by one returning a tensor shaped like its first tensor input (a residual branch). A
failure in the top module or in one of torch's own layers (they all run on the meta device: the inputs do not
fit) has the static rule count the whole module. The static rule is
``static_matmul_params``: ``nn.Linear`` weights and the in-projection weights of ``nn.MultiheadAttention``.
"""

from __future__ import annotations

import functools
import logging
import math
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakIdKeyDictionary

log = logging.getLogger(__name__)

aten = torch.ops.aten

# The positions of the two matrix operands of the aten matmul ops (the others are biases, scales, offsets).
_MATMUL_OPERAND_POSITIONS: dict[str, tuple[int, int]] = {
    "mm": (0, 1),
    "bmm": (0, 1),
    "matmul": (0, 1),
    "linear": (0, 1),
    "mv": (0, 1),
    "dot": (0, 1),
    "vdot": (0, 1),
    "addmm": (1, 2),
    "addbmm": (1, 2),
    "baddbmm": (1, 2),
    "addmv": (1, 2),
    "_addmm_activation": (1, 2),
    "_scaled_mm": (0, 1),
    "_grouped_mm": (0, 1),
}
_MATMUL_OPS: dict[Any, tuple[int, int]] = {
    getattr(aten, name): positions for name, positions in _MATMUL_OPERAND_POSITIONS.items() if hasattr(aten, name)
}
# Ops whose output holds the same elements as their first input without being a view of it.
_COPY_OPS = frozenset(getattr(aten, name) for name in ("_to_copy", "clone", "_unsafe_view") if hasattr(aten, name))

# The weights of torch's own layers that the static rule counts; nn.MultiheadAttention's out_proj is an nn.Linear.
_STATIC_WEIGHTS: tuple[tuple[type[nn.Module], tuple[str, ...]], ...] = (
    (nn.Linear, ("weight",)),
    (nn.MultiheadAttention, ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")),
)

# At most this many module types are replaced by stubs before the whole model is counted by the static rule.
MAX_STUBBED_TYPES = 4


def is_routed_expert_param(name: str) -> bool:
    """Default expert predicate: a path component of the parameter name is ``experts``.

    Matches ``layers.0.feed_forward.experts.w1`` (``examples.moe.GroupedExperts``), not ``...shared_experts.w1``.
    """
    return "experts" in name.split(".")[:-1]


@dataclass(frozen=True)
class MatmulParams:
    """What ``count_matmul_params`` found.

    ``dense``: parameter name -> its elements that enter matmuls in one forward (routed experts excluded).
    ``experts``: routed-expert parameter name -> its elements (the whole parameter).
    ``static_modules``: the modules counted by the static rule because their forward could not be traced (``""``:
    the whole module); empty when the whole forward was traced.
    """

    dense: Mapping[str, int]
    experts: Mapping[str, int]
    static_modules: tuple[str, ...] = ()

    @property
    def dense_total(self) -> int:
        return sum(self.dense.values())

    @property
    def experts_total(self) -> int:
        return sum(self.experts.values())


def canonical_param_names(module: nn.Module) -> dict[int, str]:
    """``id(parameter)`` -> its first name in ``module.named_parameters()`` (a tied parameter has one name)."""
    return {id(param): name for name, param in module.named_parameters()}


def static_matmul_params(
    module: nn.Module,
    *,
    expert_param_filter: Callable[[str], bool] = is_routed_expert_param,
    names: Mapping[int, str] | None = None,
) -> dict[str, int]:
    """The static rule: ``nn.Linear`` weights and ``nn.MultiheadAttention`` in-projection weights, name -> elements,
    routed experts excluded; each parameter once. Parameters a layer does not own (``F.linear`` on a bare
    ``nn.Parameter``, a functional output projection) are missed: this is the rule for what cannot be traced.

    ``names`` maps ``id(parameter)`` to the name to report (default: the names within ``module``).
    """
    if names is None:
        names = canonical_param_names(module)
    counted: dict[str, int] = {}
    for sub in module.modules():
        for layer_type, attributes in _STATIC_WEIGHTS:
            if not isinstance(sub, layer_type):
                continue
            for attribute in attributes:
                param = getattr(sub, attribute, None)
                if isinstance(param, torch.Tensor) and id(param) in names:
                    name = names[id(param)]
                    if not expert_param_filter(name):
                        counted[name] = param.numel()
    return counted


def _distinct_elements(tensor: torch.Tensor) -> int:
    """Elements a (possibly broadcast) view reads: broadcast dimensions (stride 0) count once."""
    return math.prod(size for size, stride in zip(tensor.shape, tensor.stride(), strict=True) if stride != 0)


class _MatmulRecorder(TorchDispatchMode):
    """Attributes the operands of aten matmuls to the parameters they are, or are views or copies of."""

    def __init__(self, sources: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self._origin: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._numel: dict[str, int] = {}
        for name, tensor in sources.items():
            self._origin[tensor] = name
            self._numel[name] = tensor.numel()
        self.elements: Counter[str] = Counter()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        packet = getattr(func, "overloadpacket", None)
        positions = _MATMUL_OPS.get(packet)
        if positions is not None:
            self._record(args, positions)
        elif args and (getattr(func, "is_view", False) or packet in _COPY_OPS):
            origin = self._origin_of(args[0])
            if origin is not None:
                for tensor in tree_leaves(out):
                    if isinstance(tensor, torch.Tensor):
                        self._origin[tensor] = origin
        return out

    def _origin_of(self, value: object) -> str | None:
        if not isinstance(value, torch.Tensor):
            return None
        origin: str | None = self._origin.get(value)
        if origin is None and value._base is not None:
            origin = self._origin.get(value._base)
        return origin

    def _record(self, args: tuple[Any, ...], positions: tuple[int, int]) -> None:
        found = [(origin, args[i]) for i in positions if i < len(args) and (origin := self._origin_of(args[i]))]
        if len(found) != 1:
            return  # no parameter, or two: no token goes through a product of parameters
        origin, operand = found[0]
        self.elements[origin] += min(_distinct_elements(operand), self._numel[origin])


def _to_meta(value: Any) -> Any:
    if not isinstance(value, torch.Tensor) or value.is_meta:
        return value
    meta = torch.empty_like(value, device="meta")
    return meta.requires_grad_() if value.requires_grad else meta


def _stub_forward(*args: Any, **kwargs: Any) -> torch.Tensor:
    """The forward of a module that cannot run on the meta device: a tensor shaped like its first tensor input."""
    first = next((leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)), None)
    if first is None:
        raise TypeError("a stubbed module got no tensor input")
    return torch.empty_like(first)


@contextmanager
def _attributes_restored(module: nn.Module) -> Iterator[None]:
    """Undo what a forward sets on the modules (statistics, caches, the stubbed forwards)."""
    saved = [(sub, dict(vars(sub))) for sub in module.modules()]
    try:
        yield
    finally:
        for sub, attributes in saved:
            current = vars(sub)
            for key in [key for key in current if key not in attributes]:
                del current[key]
            for key, value in attributes.items():
                if current.get(key) is not value:
                    current[key] = value


def _summary(error: Exception) -> str:
    """The first line of an error's message, at most 160 characters."""
    lines = str(error).splitlines()
    return lines[0][:160] if lines else ""


def _enter(active: list[str], name: str, *_: Any) -> None:
    active.append(name)


def _leave(active: list[str], name: str, *_: Any) -> None:
    while active and active.pop() != name:
        pass


def _meta_state(module: nn.Module, names: Mapping[int, str]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Meta stand-ins of every parameter and buffer under all their names (tied ones share one), and the
    parameters' stand-ins by canonical name."""
    state: dict[str, torch.Tensor] = {}
    by_id: dict[int, torch.Tensor] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) not in by_id:
            meta = torch.empty(param.shape, dtype=param.dtype, device="meta")
            by_id[id(param)] = nn.Parameter(meta, requires_grad=param.requires_grad)
        state[name] = by_id[id(param)]
    sources = {names[i]: tensor for i, tensor in by_id.items()}
    for name, buffer in module.named_buffers(remove_duplicate=False):
        if id(buffer) not in by_id:
            by_id[id(buffer)] = torch.empty_like(buffer, device="meta")
        state[name] = by_id[id(buffer)]
    return state, sources


@dataclass(frozen=True)
class _TraceFailure:
    module_name: str
    module_type: type[nn.Module]
    error: Exception


def _trace(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    stubbed: tuple[type[nn.Module], ...],
    names: Mapping[int, str],
) -> Counter[str] | _TraceFailure:
    """Matmul elements per parameter of one meta forward, or where it failed (the innermost module running; the
    top module for a failure outside the forward)."""
    active: list[str] = []
    try:
        state, sources = _meta_state(module, names)
        recorder = _MatmulRecorder(sources)
        with ExitStack() as stack:
            stack.enter_context(_attributes_restored(module))
            for name, sub in module.named_modules():
                stack.callback(sub.register_forward_pre_hook(functools.partial(_enter, active, name)).remove)
                stack.callback(sub.register_forward_hook(functools.partial(_leave, active, name)).remove)
                if stubbed and sub is not module and isinstance(sub, stubbed):
                    sub.__dict__["forward"] = _stub_forward
            stack.enter_context(torch.random.fork_rng(devices=[]))
            stack.enter_context(torch.enable_grad())
            with recorder:
                functional_call(module, state, tree_map(_to_meta, args), tree_map(_to_meta, dict(kwargs)))
    except Exception as error:
        failed = active[-1] if active else ""
        return _TraceFailure(failed, type(module.get_submodule(failed)), error)
    return recorder.elements


def count_matmul_params(
    module: nn.Module,
    example_inputs: torch.Tensor | tuple[Any, ...] | None,
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    expert_param_filter: Callable[[str], bool] = is_routed_expert_param,
) -> MatmulParams:
    """The parameters of ``module`` that enter matmuls in one forward of ``module(*example_inputs,
    **example_kwargs)`` traced on the meta device (see the module docstring). The inputs may be on any device (only
    their shapes and dtypes are used); one sequence of the training length is enough, the count does not depend
    on the batch. Without inputs (``None``), or if even the top module cannot run on the meta device, the static
    rule counts everything (logged).

    Never raises from the trace: a failure is logged and counted by the static rule. Call it on the whole,
    unsharded model (e.g. a meta-device copy): a pipeline stage or sharded experts hold only part of the weights.
    """
    names = canonical_param_names(module)
    experts = {name: param.numel() for name, param in module.named_parameters() if expert_param_filter(name)}
    if example_inputs is None:
        log.info("matmul parameters: no example input, counting nn.Linear and nn.MultiheadAttention weights")
        return MatmulParams(static_matmul_params(module, expert_param_filter=expert_param_filter), experts, ("",))
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    stubbed: list[type[nn.Module]] = []
    while True:
        result = _trace(module, args, example_kwargs or {}, tuple(stubbed), names)
        if not isinstance(result, _TraceFailure):
            return _with_static_modules(module, result, tuple(stubbed), names, experts, expert_param_filter)
        if not _can_stub(result) or result.module_type in stubbed or len(stubbed) == MAX_STUBBED_TYPES:
            log.warning(
                "matmul parameters: the forward cannot be traced on the meta device (%s in %r: %s); "
                "counting nn.Linear and nn.MultiheadAttention weights",
                type(result.error).__name__,
                result.module_name,
                _summary(result.error),
            )
            return MatmulParams(static_matmul_params(module, expert_param_filter=expert_param_filter), experts, ("",))
        log.info(
            "matmul parameters: %s modules (first %r) cannot run on the meta device (%s: %s); counting their "
            "nn.Linear and nn.MultiheadAttention weights",
            result.module_type.__name__,
            result.module_name,
            type(result.error).__name__,
            _summary(result.error),
        )
        stubbed.append(result.module_type)


def _can_stub(failure: _TraceFailure) -> bool:
    """Not the top module, nor one of torch's own layers (they run on the meta device: the inputs do not fit)."""
    return failure.module_name != "" and not failure.module_type.__module__.startswith("torch.")


def _with_static_modules(
    module: nn.Module,
    traced: Counter[str],
    stubbed: tuple[type[nn.Module], ...],
    names: Mapping[int, str],
    experts: dict[str, int],
    expert_param_filter: Callable[[str], bool],
) -> MatmulParams:
    """The traced counts, and the static rule's for the parameters of stubbed modules that no traced matmul used."""
    dense = {name: elements for name, elements in traced.items() if not expert_param_filter(name)}
    static_modules: list[str] = []
    for name, sub in module.named_modules():
        if name and stubbed and isinstance(sub, stubbed):
            static_modules.append(name)
            static = static_matmul_params(sub, expert_param_filter=expert_param_filter, names=names)
            for param_name, elements in static.items():
                dense.setdefault(param_name, elements)
    return MatmulParams(dense, experts, tuple(static_modules))
