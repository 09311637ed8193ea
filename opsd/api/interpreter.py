"""The interpreter of a process that answers thousands of requests a second beside hundreds of thousands of long-lived
objects (the controller's records of ~100,000 ranks; a heartbeat process's 12,288 connections): its garbage
collector tuned so that no collection holds a request up for long.

- the young generations are collected on a schedule (``collect_young``): each request leaves objects that live until
  the next request on its keep-alive connection, and as each of those is freed the collector counts one allocation
  less, so left to itself it puts its young collections off until they hold ~45,000 objects (25-35 ms pauses);
- a full collection waits for 10,000 collections of the middle generation rather than 10: every several minutes
  at 3,000 requests a second, not every 2 to 3 seconds (each takes ~150 ms over the long-lived objects at that
  scale; they hold no reference cycles, they are freed as they go);
- what is built at start (modules, the app) is moved out of the collector's way (``gc.freeze``).
"""

from __future__ import annotations

import gc

YOUNG_EVERY_S = 0.1


def tune_collector() -> None:
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, 10_000)
    gc.collect()
    gc.freeze()


def collect_young() -> None:
    """Collect the two young generations (a few milliseconds): every ``YOUNG_EVERY_S``."""
    gc.collect(1)
