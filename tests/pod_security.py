"""What admission refuses in a pod spec, for tests that have no API server: the Pod Security Standards' ``baseline``
and ``restricted`` levels as the Pod Security admission controller enforces them at ``latest`` (the controls of
kubernetes.io/docs/concepts/security/pod-security-standards, field by field), and the API server's own validation
rules on a container's securityContext that no schema expresses (pkg/apis/core/validation).

    violations(pod_spec, "baseline")   # [] when a namespace labelled pod-security.kubernetes.io/enforce=baseline
                                       # admits the pod; else one line per control it breaks
    api_refusals(pod_spec)             # [] when the API server's validation lets the securityContexts through

Not checked: the Windows-only fields beyond hostProcess, and the version-specific relaxations of older levels.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

Json = dict[str, Any]
LEVELS = ("privileged", "baseline", "restricted")

BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)
SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
    }
)
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
RESTRICTED_VOLUMES = frozenset(
    {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
)


def containers(spec: Json) -> Iterator[tuple[str, Json]]:
    for field in ("initContainers", "containers", "ephemeralContainers"):
        for c in spec.get(field) or []:
            yield f"{field}[{c.get('name')}]", c


def _contexts(spec: Json) -> Iterator[tuple[str, Json]]:
    """The pod's securityContext, then each container's."""
    yield "spec.securityContext", spec.get("securityContext") or {}
    for where, c in containers(spec):
        yield f"{where}.securityContext", c.get("securityContext") or {}


def _baseline(spec: Json) -> Iterator[str]:
    for where, sc in _contexts(spec):
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            yield f"HostProcess: {where}.windowsOptions.hostProcess"
        selinux = sc.get("seLinuxOptions") or {}
        if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
            yield f"SELinux: {where}.seLinuxOptions {selinux}"
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            yield f"Seccomp: {where}.seccompProfile Unconfined"
        if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
            yield f"AppArmor: {where}.appArmorProfile Unconfined"
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            yield f"Host namespaces: spec.{field}"
    for volume in spec.get("volumes") or []:
        if "hostPath" in volume:
            yield f"HostPath volumes: volume {volume.get('name')}"
    for name in [s.get("name") for s in (spec.get("securityContext") or {}).get("sysctls") or []]:
        if name not in SAFE_SYSCTLS:
            yield f"Sysctls: {name}"
    for where, c in containers(spec):
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            yield f"Privileged containers: {where}"
        for cap in (sc.get("capabilities") or {}).get("add") or []:
            if cap not in BASELINE_CAPABILITIES:
                yield f"Capabilities: {where} adds {cap}"
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                yield f"Host ports: {where} hostPort {port['hostPort']}"
        if sc.get("procMount", "Default") != "Default":
            yield f"/proc mount type: {where} {sc['procMount']}"


def _restricted(spec: Json) -> Iterator[str]:
    for volume in spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            yield f"Volume types: volume {volume.get('name')} is {sorted(kinds)}"
    pod = spec.get("securityContext") or {}
    pod_seccomp = (pod.get("seccompProfile") or {}).get("type")
    if pod.get("runAsUser") == 0:
        yield "Running as non-root user: spec.securityContext.runAsUser 0"
    for where, c in containers(spec):
        sc = c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            yield f"Privilege escalation: {where} does not set allowPrivilegeEscalation: false"
        non_root = sc.get("runAsNonRoot", pod.get("runAsNonRoot"))
        if non_root is not True:
            yield f"Running as non-root: {where} (runAsNonRoot not true, at the pod or the container)"
        if sc.get("runAsUser") == 0:
            yield f"Running as non-root user: {where} runAsUser 0"
        seccomp = (sc.get("seccompProfile") or {}).get("type") or pod_seccomp
        if seccomp not in ("RuntimeDefault", "Localhost"):
            yield f"Seccomp: {where} has no RuntimeDefault or Localhost profile (at the pod or the container)"
        capabilities = sc.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            yield f"Capabilities: {where} does not drop ALL"
        for cap in capabilities.get("add") or []:
            if cap != "NET_BIND_SERVICE":
                yield f"Capabilities: {where} adds {cap} (restricted allows NET_BIND_SERVICE only)"


def violations(spec: Json, level: str) -> list[str]:
    """The controls of ``level`` that the pod ``spec`` breaks (``[]``: admitted)."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}")
    if level == "privileged":
        return []
    found = list(_baseline(spec))
    if level == "restricted":
        found += list(_restricted(spec))
    return found


def level_of(spec: Json) -> str:
    """The strictest level that admits the pod."""
    return next(level for level in reversed(LEVELS) if not violations(spec, level))


def api_refusals(spec: Json) -> list[str]:
    """What the API server's validation refuses in the containers' securityContexts (ValidateSecurityContext)."""
    out = []
    for where, c in containers(spec):
        sc = c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is False:
            if sc.get("privileged"):
                out.append(f"{where}: cannot set allowPrivilegeEscalation to false and privileged to true")
            if "CAP_SYS_ADMIN" in ((sc.get("capabilities") or {}).get("add") or []):
                out.append(f"{where}: cannot set allowPrivilegeEscalation to false and capabilities.Add CAP_SYS_ADMIN")
    return out
