"""Spare-pool sizing (binomial P99) and spare choice, as tables of named cases."""

from __future__ import annotations

import math

import pytest

from opsd.policy.spares import Spare, binomial_tail, failure_probability, select_spare, spare_pool_size


def brute_tail(n: int, p: float, s: int) -> float:
    """P(X > s) as one minus the directly summed probabilities of 0..s failures (an independent computation)."""
    return 1.0 - sum(math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(min(s, n) + 1))


@pytest.mark.parametrize(("n", "p", "s"), [(10, 0.1, 0), (10, 0.1, 2), (50, 0.02, 3), (7, 0.5, 6), (7, 0.5, 7)])
def test_binomial_tail_matches_the_sum(n: int, p: float, s: int) -> None:
    assert binomial_tail(n, p, s) == pytest.approx(brute_tail(n, p, s), abs=1e-12)


SIZES = {
    # name: (nodes, repair window h, node MTBF h, expected pool)
    "no nodes, no spares": (0, 24, 1000, 0),
    "tiny risk: none needed": (4, 1, 1e9, 0),
    "48 nodes, 1 day, 1 failure/node/5 years": (48, 24, 5 * 8760, 1),
    "BLOOM-like 48 nodes, 1.5 failures a week, a week to repair": (48, 24 * 7, 48 * 24 * 7 / 1.5, 5),
    "1,024 nodes, 1 day, 3 years": (1024, 24, 3 * 8760, 4),
    "3,072 nodes (Llama 3 scale), 1 day, 2 years": (3072, 24, 2 * 8760, 10),
}


@pytest.mark.parametrize(("nodes", "window_h", "mtbf_h", "pool"), SIZES.values(), ids=SIZES.keys())
def test_pool_size_is_the_smallest_with_at_most_1_percent_risk(
    nodes: int, window_h: float, mtbf_h: float, pool: int
) -> None:
    size = spare_pool_size(nodes, window_h, mtbf_h)
    assert size == pool
    p = -math.expm1(-window_h / mtbf_h)
    assert failure_probability(window_h, mtbf_h) == pytest.approx(p)
    assert brute_tail(nodes, p, size) <= 0.01 + 1e-12
    if size > 0:
        assert brute_tail(nodes, p, size - 1) > 0.01  # one fewer would be too few


CHOICES: dict[str, tuple[list[Spare], str, str | None]] = {
    "same domain first": ([Spare("a", True, "rack1"), Spare("b", True, "rack2")], "rack2", "b"),
    "any healthy when none in the domain": ([Spare("c", True, "rack1"), Spare("b", True, "rack1")], "rack9", "b"),
    "unhealthy skipped": ([Spare("a", False, "rack2"), Spare("b", True, "rack1")], "rack2", "b"),
    "none left": ([Spare("a", False)], "", None),
    "unknown domain: by name": ([Spare("z", True), Spare("y", True)], "", "y"),
}


@pytest.mark.parametrize(("spares", "domain", "chosen"), CHOICES.values(), ids=CHOICES.keys())
def test_select_spare(spares: list[Spare], domain: str, chosen: str | None) -> None:
    got = select_spare(spares, domain)
    assert (got.node if got else None) == chosen


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: spare_pool_size(-1, 1, 1), "nodes"),
        (lambda: spare_pool_size(1, 1, 1, risk=0), "risk"),
        (lambda: failure_probability(1, 0), "node_mtbf_h"),
        (lambda: binomial_tail(3, 1.5, 1), "p <= 1"),
    ],
    ids=["nodes", "risk", "mtbf", "p"],
)
def test_bad_arguments(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()  # type: ignore[operator]
