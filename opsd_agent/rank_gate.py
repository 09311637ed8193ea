"""What the agent asks of a rank that reaches it over the network: its run's key (``opsd.protocol.rank_auth``).

A datagram from the UDP port, ``GET /v1/policy`` and ``POST /v1/flight-recorder`` pass the gate; the Unix socket does
not (who may write it is the host directory's permissions). Refusals are counted by reason (the datagrams' in
``opsd_agent_datagrams_rejected_total``, the requests' in ``opsd_agent_requests_refused_total``); in ``optional``
mode what came unsigned and was taken is counted in ``opsd_agent_unsigned_total``, so that an operator sees which
endpoints still get unsigned reports before asking for the key (``required``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from functools import lru_cache

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from opsd.protocol.rank_auth import RankAuth, key_ok, run_key, verify

#: why a datagram was refused (beside the wire format's reasons)
DATAGRAM_REFUSALS = ("signature", "unsigned", "bad_signature")
#: why a request was refused
REQUEST_REFUSALS = ("unsigned", "bad_key", "other_run")
ENDPOINTS = ("datagram", "policy", "flight_recorder")


class RankGate:
    def __init__(self, secret: str, mode: RankAuth) -> None:
        if mode is not RankAuth.OFF and not secret:
            raise ValueError(f"rank_auth {mode.value} needs the ranks' secret")
        self.secret, self.mode = secret, mode
        self.refused = dict.fromkeys(REQUEST_REFUSALS, 0)
        self.unsigned = dict.fromkeys(ENDPOINTS, 0)
        self._lock = threading.Lock()
        self._key = lru_cache(maxsize=1024)(lambda run: run_key(secret, run))

    def refuses(self, tag: bytes | None, body: bytes, run: str) -> str | None:
        """Why a datagram of ``run`` with this ``tag`` (None: unsigned) is refused; None: it is taken."""
        if self.mode is RankAuth.OFF:
            return None
        if tag is None:
            return self._unsigned("datagram")
        return None if verify(tag, body, self._key(run)) else "bad_signature"

    def refuses_request(self, authorization: str | None, run: str | None, endpoint: str) -> str | None:
        """Why a request with these headers (``Authorization``, ``X-Opsd-Run``) is refused (counted); None: it is
        served."""
        if self.mode is RankAuth.OFF:
            return None
        if not authorization or not authorization.startswith("Bearer "):
            reason = self._unsigned(endpoint)
        else:
            presented = authorization.removeprefix("Bearer ").strip()
            reason = None if key_ok(presented, run or "", self.secret) else "bad_key"
        if reason is not None:
            self.count_refused(reason)
        return reason

    def count_refused(self, reason: str) -> None:
        with self._lock:
            self.refused[reason] += 1

    def _unsigned(self, endpoint: str) -> str | None:
        if self.mode is RankAuth.REQUIRED:
            return "unsigned"
        with self._lock:
            self.unsigned[endpoint] += 1
        return None


class RankGateCollector(Collector):
    def __init__(self, gate: RankGate, node: str) -> None:
        self.gate, self.node = gate, node

    def collect(self) -> Iterator[Metric]:
        refused = CounterMetricFamily(
            "opsd_agent_requests_refused",
            "Requests of ranks to /v1/policy or /v1/flight-recorder refused for their run's key: none (unsigned, "
            "where it is required), a wrong one (bad_key), or a dump of another run than the key's (other_run).",
            labels=["node", "reason"],
        )
        for reason, n in self.gate.refused.items():
            refused.add_metric([self.node, reason], n)
        yield refused
        unsigned = CounterMetricFamily(
            "opsd_agent_unsigned",
            "Datagrams and requests of ranks taken without their run's key (agent.rank_auth optional), by endpoint.",
            labels=["node", "endpoint"],
        )
        for endpoint, n in self.gate.unsigned.items():
            unsigned.add_metric([self.node, endpoint], n)
        yield unsigned
