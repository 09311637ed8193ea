"""The Pod Security checks the chart's and the docs' pods are held to (tests/pod_security.py): each control catches
its breach, by a table of named cases, each the smallest change to a pod that "restricted" admits."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.pod_security import api_refusals, level_of, violations

Json = dict[str, Any]

RESTRICTED: Json = {
    "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
    "containers": [
        {
            "name": "trainer",
            "image": "trainer:1",
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
            "ports": [{"containerPort": 29500}],
        }
    ],
    "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}, {"name": "c", "configMap": {"name": "x"}}],
}


def changed(path: str, value: Any) -> Json:
    """RESTRICTED with one field set (a dotted path; ``containers.0`` indexes the list)."""
    spec = copy.deepcopy(RESTRICTED)
    *parents, leaf = path.split(".")
    target: Any = spec
    for part in parents:
        target = target[int(part)] if isinstance(target, list) else target.setdefault(part, {})
    target[leaf] = value
    return spec


CASES = [
    pytest.param(RESTRICTED, "restricted", id="restricted"),
    pytest.param(changed("containers.0.securityContext.capabilities", {}), "baseline", id="no-drop-all"),
    pytest.param(changed("containers.0.securityContext.allowPrivilegeEscalation", True), "baseline", id="escalation"),
    pytest.param(changed("securityContext.runAsNonRoot", False), "baseline", id="may-run-as-root"),
    pytest.param(changed("securityContext.runAsUser", 0), "baseline", id="root-user"),
    pytest.param(changed("securityContext.seccompProfile", {}), "baseline", id="no-seccomp"),
    pytest.param(changed("volumes", [{"name": "d", "nfs": {"server": "s", "path": "/"}}]), "baseline", id="nfs"),
    pytest.param(changed("containers.0.securityContext.capabilities.add", ["CHOWN"]), "baseline", id="cap-chown"),
    pytest.param(changed("volumes", [{"name": "h", "hostPath": {"path": "/run/opsd"}}]), "privileged", id="hostpath"),
    pytest.param(changed("containers.0.ports", [{"containerPort": 1, "hostPort": 1}]), "privileged", id="hostport"),
    pytest.param(changed("hostNetwork", True), "privileged", id="host-network"),
    pytest.param(changed("containers.0.securityContext.privileged", True), "privileged", id="privileged"),
    pytest.param(changed("containers.0.securityContext.capabilities.add", ["SYS_ADMIN"]), "privileged", id="sys-admin"),
    pytest.param(changed("containers.0.securityContext.capabilities.add", ["IPC_LOCK"]), "privileged", id="ipc-lock"),
    pytest.param(changed("securityContext.sysctls", [{"name": "net.core.somaxconn"}]), "privileged", id="sysctl"),
    pytest.param(changed("securityContext.seccompProfile", {"type": "Unconfined"}), "privileged", id="unconfined"),
    pytest.param(changed("containers.0.securityContext.procMount", "Unmasked"), "privileged", id="proc-unmasked"),
    pytest.param(changed("securityContext.seLinuxOptions", {"type": "spc_t"}), "privileged", id="selinux"),
]


@pytest.mark.parametrize(("spec", "level"), CASES)
def test_each_control_catches_its_breach(spec: Json, level: str) -> None:
    assert level_of(spec) == level
    if level != "restricted":
        assert violations(spec, "restricted")


def test_the_api_servers_own_refusals() -> None:
    both = changed("containers.0.securityContext.privileged", True)
    assert api_refusals(both) == [
        "containers[trainer]: cannot set allowPrivilegeEscalation to false and privileged to true"
    ]
    admin = changed("containers.0.securityContext.capabilities.add", ["CAP_SYS_ADMIN"])
    assert len(api_refusals(admin)) == 1
    assert api_refusals(RESTRICTED) == []
