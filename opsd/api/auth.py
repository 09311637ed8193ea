"""Who may call what on the controller's API: a bearer token per role (docs/kubernetes.md, "Credentials").

- ``operator`` (``controller.token``): everything, the reads, restart, cordon, uncordon, attach, inject (and what
  the others may);
- ``reader`` (``controller.reader_token``): every read: runs, incidents, post-mortems, checkpoints, Flight Recorder
  dumps, ``/metrics``;
- ``agent`` (``controller.agent_token``): heartbeats and Flight Recorder uploads (an agent's credential lives on
  every GPU node: it reads nothing);
- ``metrics`` (``controller.metrics_token``): ``/metrics``, Prometheus's scrape credential.

A role may also have its previous token (``*_previous``): during a rotation the old token and the new are both
taken, until the next rotation replaces the previous one (docs/kubernetes.md, "Credentials").

Every endpoint but ``/healthz`` wants one. No token, or one the controller does not know: 401 (counted as
``auth``); a known token whose role may not: 403 (counted as ``forbidden``). A role without a token of its own is
simply not given (the operator's token does its work: a single-token controller, as ``opsd run`` starts, works as
before).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import HTTPException

from opsd.protocol.states import ApiRole


@dataclass(frozen=True)
class Credentials:
    operator: str
    reader: str = ""
    agent: str = ""
    metrics: str = ""
    # the tokens the roles had before the last rotation, still taken
    operator_previous: str = ""
    reader_previous: str = ""
    agent_previous: str = ""
    metrics_previous: str = ""

    def __post_init__(self) -> None:
        if not self.operator:
            raise ValueError("the controller needs a token for its operators")
        tokens = self.tokens()
        if len(tokens) != len({token for _, token in tokens}):
            raise ValueError("each role needs a token of its own: two roles share one")

    def tokens(self) -> list[tuple[ApiRole, str]]:
        """Every token taken, with its role (a previous token equal to its role's current one counted once)."""
        pairs = [
            (ApiRole.OPERATOR, self.operator, self.operator_previous),
            (ApiRole.READER, self.reader, self.reader_previous),
            (ApiRole.AGENT, self.agent, self.agent_previous),
            (ApiRole.METRICS, self.metrics, self.metrics_previous),
        ]
        found = [(role, current) for role, current, _ in pairs if current]
        found += [(role, previous) for role, current, previous in pairs if previous and previous != current]
        return found

    def role_of(self, authorization: str | None) -> ApiRole | None:
        """The role whose token an ``Authorization: Bearer <token>`` header carries; None for none."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        presented = authorization.removeprefix("Bearer ").strip().encode()
        found = None
        for role, token in self.tokens():
            # every token compared, in constant time: how long it takes says nothing of which matched
            if hmac.compare_digest(presented, token.encode()):
                found = role
        return found


def check(credentials: Credentials, authorization: str | None, allowed: frozenset[ApiRole]) -> str | None:
    """None when the header's role may; else the reason to refuse: ``auth`` (401) or ``forbidden`` (403)."""
    role = credentials.role_of(authorization)
    if role is None:
        return "auth"
    if role is ApiRole.OPERATOR or role in allowed:
        return None
    return "forbidden"


def refusal(reason: str, allowed: frozenset[ApiRole]) -> HTTPException:
    if reason == "auth":
        return HTTPException(401, "a valid bearer token is required", headers={"WWW-Authenticate": "Bearer"})
    roles = ", ".join(sorted({ApiRole.OPERATOR, *allowed}))
    return HTTPException(403, f"this token's role may not do this (it takes: {roles})")


def requirement(
    credentials: Credentials, reject: Callable[[str], None], *allowed: ApiRole
) -> Callable[[str | None], None]:
    """A FastAPI dependency (its argument the ``Authorization`` header) letting ``allowed`` roles, and operators,
    through; refusals counted by ``reject``."""
    roles = frozenset(allowed)

    def dependency(authorization: str | None) -> None:
        reason = check(credentials, authorization, roles)
        if reason is not None:
            reject(reason)
            raise refusal(reason, roles)

    return dependency
