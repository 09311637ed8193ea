"""Where a run is on the cluster: its JobSet, the Kubernetes backend's own part of the run's spec (``RunSpec.own``),
and the target ``opsd runs attach`` names."""

from __future__ import annotations

import re

import msgspec

from opsd.errors import BodyError

#: a namespace's or a JobSet's name (RFC 1123 subdomain)
OBJECT_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


class RunRef(msgspec.Struct, frozen=True):
    """Where a run is: its JobSet. ``attached``: made a run by ``opsd runs attach`` (its JobSet has no
    ``opsd.io/run`` annotation)."""

    namespace: str
    jobset: str
    attached: bool = False


def attached_ref(target: str) -> RunRef:
    """``NAMESPACE/JOBSET`` as a JobSet attached; ``BodyError`` saying what is wrong with it."""
    namespace, slash, jobset = target.partition("/")
    if not slash:
        raise BodyError(f"{target!r}: expected NAMESPACE/JOBSET")
    for what, value in (("namespace", namespace), ("jobset", jobset)):
        if not OBJECT_NAME.match(value):
            raise BodyError(f"{what} {value!r} is not a Kubernetes object name")
    return RunRef(namespace, jobset, attached=True)
