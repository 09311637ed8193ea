"""Context-parallel attention issues one functional collective at a time on its group: two in flight at once on
one gloo group corrupt the heap (docs/crash.md). Single process, a gloo world of one."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore  # type: ignore[attr-defined]
from torch.distributed import _functional_collectives as funcol

from examples.config import ModelConfig
from examples.model import Attention, rotary_tables

CFG = ModelConfig(dim=16, n_heads=2, n_kv_heads=1, ffn_hidden=24, seq_len=8)
COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single")


@dataclass
class InFlight:
    """Functional collectives issued, and those issued while another on the same group was not yet waited for."""

    issued: list[str] = field(default_factory=list)
    overlapping: list[str] = field(default_factory=list)
    unwaited: dict[str, set[int]] = field(default_factory=dict)


@contextmanager
def functional_collectives() -> Iterator[InFlight]:
    """Watch ``torch.ops._c10d_functional`` collectives and ``funcol.wait_tensor`` (what both the forward's
    AsyncCollectiveTensor and the backward's formulas call) while the block runs."""
    seen = InFlight()
    namespace = torch.ops._c10d_functional
    originals = {name: getattr(namespace, name) for name in COLLECTIVES}
    original_wait = funcol.wait_tensor

    def watch(name: str, op: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            out = op(*args, **kwargs)
            group = str(args[-1])
            seen.issued.append(name)
            if seen.unwaited.get(group):
                seen.overlapping.append(name)
            seen.unwaited.setdefault(group, set()).add(out.untyped_storage().data_ptr())
            return out

        return call

    def wait(tensor: torch.Tensor) -> torch.Tensor:
        inner = tensor.elem if isinstance(tensor, funcol.AsyncCollectiveTensor) else tensor
        for pending in seen.unwaited.values():
            pending.discard(inner.untyped_storage().data_ptr())
        return original_wait(tensor)

    for name, op in originals.items():
        setattr(namespace, name, watch(name, op))
    funcol.wait_tensor = wait
    try:
        yield seen
    finally:
        for name, op in originals.items():
            setattr(namespace, name, op)
        funcol.wait_tensor = original_wait


@pytest.fixture
def gloo_world() -> Iterator[dist.ProcessGroup]:
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        assert dist.group.WORLD is not None
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_keys_and_values_are_gathered_in_one_collective(gloo_world: dist.ProcessGroup) -> None:
    torch.manual_seed(0)
    plain = Attention(CFG)
    context_parallel = copy.deepcopy(plain)
    context_parallel.cp_group = gloo_world  # a cp group of one: the whole sequence, offset 0
    cos, sin = rotary_tables(CFG.head_dim, CFG.seq_len, CFG.rope_theta)
    x = torch.randn(2, CFG.seq_len, CFG.dim)
    x_cp = x.clone().requires_grad_()
    x_plain = x.clone().requires_grad_()

    with functional_collectives() as seen:
        out = context_parallel(x_cp, cos, sin, 0)
        out.square().sum().backward()
    expected = plain(x_plain, cos, sin, 0)
    expected.square().sum().backward()

    assert seen.issued == ["all_gather_into_tensor", "reduce_scatter_tensor"]  # keys and values together
    assert seen.overlapping == []
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x_cp.grad, x_plain.grad)
    for (name, p_cp), p_plain in zip(context_parallel.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p_cp.grad, p_plain.grad, msg=name)


def test_the_watch_sees_two_gathers_in_flight(gloo_world: dist.ProcessGroup) -> None:
    """What the test above would see of an attention that gathered keys, then values, before waiting."""
    k, v = torch.randn(4, 2), torch.randn(4, 2)
    with functional_collectives() as seen:
        in_flight = [funcol.all_gather_tensor(t, 0, gloo_world) for t in (k, v)]
        gathered = [funcol.wait_tensor(t) for t in in_flight]
        again = funcol.wait_tensor(funcol.all_gather_tensor(k, 0, gloo_world))
    assert seen.issued == ["all_gather_into_tensor"] * 3
    assert seen.overlapping == ["all_gather_into_tensor"]  # the second of the pair; the third came after the waits
    torch.testing.assert_close(gathered, [k, v])
    torch.testing.assert_close(again, k)
