"""How many hot spares to keep, and which one to bring in.

- Pool size: failures among ``nodes`` nodes during one repair window are Binomial(nodes, p), with p the
  probability that one node fails within the window, p = 1 - exp(-window / node MTBF). The pool is the smallest s
  with P(failures > s) <= ``risk`` (1% by default): the P99 of the binomial, as ByteRobust sizes its pool.
- Choice: a healthy spare in the failed node's topology domain (same switch, rack or NVLink domain) first, then
  any healthy spare; by name within each, so the choice is deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


def failure_probability(window_h: float, node_mtbf_h: float) -> float:
    """P(one node fails within ``window_h``) for exponential failures."""
    if window_h < 0 or node_mtbf_h <= 0:
        raise ValueError("window_h must be >= 0 and node_mtbf_h > 0")
    return -math.expm1(-window_h / node_mtbf_h)


def binomial_tail(n: int, p: float, s: int) -> float:
    """P(X > s) for X ~ Binomial(n, p)."""
    if n < 0 or not 0 <= p <= 1:
        raise ValueError("n must be >= 0 and 0 <= p <= 1")
    if s >= n:
        return 0.0
    if s < 0:
        return 1.0
    if p == 0:
        return 0.0
    if p == 1:
        return 1.0
    # pmf by recurrence in log space: exact enough for n in the hundred thousands
    log_pmf = n * math.log1p(-p)
    ratio = math.log(p) - math.log1p(-p)
    cdf = math.exp(log_pmf)
    for k in range(s):
        log_pmf += math.log(n - k) - math.log(k + 1) + ratio
        cdf += math.exp(log_pmf)
    return max(0.0, 1.0 - cdf)


def spare_pool_size(nodes: int, window_h: float, node_mtbf_h: float, risk: float = 0.01) -> int:
    """The smallest pool s with P(more than s of ``nodes`` fail within ``window_h``) <= ``risk``."""
    if nodes < 0:
        raise ValueError("nodes must be >= 0")
    if not 0 < risk < 1:
        raise ValueError("risk must be between 0 and 1")
    p = failure_probability(window_h, node_mtbf_h)
    for s in range(nodes + 1):
        if binomial_tail(nodes, p, s) <= risk:
            return s
    return nodes


@dataclass(frozen=True)
class Spare:
    node: str
    healthy: bool
    domain: str = ""  # topology domain (switch, rack, NVLink domain): "" when unknown


def select_spare(spares: Iterable[Spare], failed_domain: str = "") -> Spare | None:
    """The spare to bring in for a node of ``failed_domain``, or None when no healthy spare is left."""
    healthy = sorted((s for s in spares if s.healthy), key=lambda s: s.node)
    same = [s for s in healthy if failed_domain and s.domain == failed_domain]
    choices = same or healthy
    return choices[0] if choices else None
