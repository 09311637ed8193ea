"""The spare pool a situation implies, computed here term by term (``math.comb``), apart from
``opsd.policy.spares``: the smallest pool s with P(more than s of ``nodes`` fail within ``window_h``) <= ``risk``,
each node failing in the window with p = 1 - exp(-window_h / node_mtbf_h)."""

from __future__ import annotations

import math


def implied_pool(nodes: int, node_mtbf_h: float, window_h: float, risk: float) -> int:
    p = 1.0 - math.exp(-window_h / node_mtbf_h)
    for s in range(nodes + 1):
        tail = sum(math.comb(nodes, k) * p**k * (1.0 - p) ** (nodes - k) for k in range(s + 1, nodes + 1))
        if tail <= risk:
            return s
    return nodes
