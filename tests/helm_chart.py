"""The Helm chart (helm/opsd) as its tests see it: a real helm v4 found and run (``Helm``), the matrix of values sets x
Kubernetes versions x the Prometheus Operator's API that every rendering is checked over (``COMBOS``), the CRD
schemas of tests/schemas/, and the lookups the tests read rendered objects with. The renderings of the matrix are
session fixtures (``renders`` and ``default``, in tests/conftest.py), made once for every test module of the chart.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import yaml  # type: ignore[import-untyped]

Obj = dict[str, Any]

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "opsd"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
DASHBOARDS = ROOT / "dashboards"
RULES = DASHBOARDS / "rules" / "opsd.rules.yaml"
JOBSET_EXAMPLE = ROOT / "docs" / "examples" / "jobset.yaml"

RELEASE = "opsd"
NAMESPACE = "opsd"
KUBE_VERSIONS = ("1.29.0", "1.37.0")  # the chart's kubeVersion floor, and the newest kubernetes-validate knows
MONITORING_API = "monitoring.coreos.com/v1"
# `helm lint` has no --api-versions: the chart's apiVersions value tells it (and any render without a cluster)
API_ARGS = ("--set-json", f'apiVersions=["{MONITORING_API}"]')
MONITORING_KINDS = {"serviceMonitor": "ServiceMonitor", "podMonitor": "PodMonitor", "prometheusRule": "PrometheusRule"}
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule.json",
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): "jobset.json",
}
VALUE_SETS = ("default", *sorted(p.name for p in (CHART / "ci").glob("*.yaml")))


def find_helm() -> str | None:
    """.venv/bin/helm of the repository (what `make` installs), else $OPSD_HELM, else helm on PATH."""
    local = ROOT / ".venv" / "bin" / "helm"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    env = os.environ.get("OPSD_HELM")
    if env and Path(env).is_file():
        return env
    return shutil.which("helm")


@dataclass(frozen=True)
class Combo:
    values: str  # "default" or the name of a file in helm/opsd/ci
    kube: str
    api: bool  # whether monitoring.coreos.com/v1 is served

    @property
    def id(self) -> str:
        minor = self.kube.rsplit(".", 1)[0]
        return f"{self.values.removesuffix('-values.yaml')}-k{minor}-{'api' if self.api else 'noapi'}"


COMBOS = [Combo(v, k, a) for v in VALUE_SETS for k in KUBE_VERSIONS for a in (True, False)]
DEFAULT = Combo("default", "1.37.0", True)


def values_args(values: str) -> list[str]:
    return [] if values == "default" else ["-f", str(CHART / "ci" / values)]


def values_of(values: str) -> Obj:
    """The values a set overrides ({} for the defaults)."""
    return {} if values == "default" else yaml.safe_load((CHART / "ci" / values).read_text()) or {}


@dataclass(frozen=True)
class Helm:
    path: str

    def run(
        self, verb: str, *args: str, chart: Path | str = CHART, release: str = RELEASE
    ) -> subprocess.CompletedProcess[str]:
        """`helm VERB [RELEASE] CHART ARGS...` (the release name for template and install)."""
        named = [release] if verb in ("template", "install") else []
        cmd = [self.path, verb, *named, str(chart), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)

    def template(
        self, *args: str, kube: str = "1.37.0", api: bool = True, chart: Path | str = CHART
    ) -> subprocess.CompletedProcess[str]:
        api_args = ["--api-versions", MONITORING_API] if api else []
        return self.run("template", "--namespace", NAMESPACE, "--kube-version", kube, *api_args, *args, chart=chart)

    def render(self, *args: str, kube: str = "1.37.0", api: bool = True) -> list[Obj]:
        proc = self.template(*args, kube=kube, api=api)
        assert proc.returncode == 0, proc.stderr
        return parse(proc.stdout)


def parse(manifest: str) -> list[Obj]:
    return [doc for doc in yaml.safe_load_all(manifest) if doc]


def objects(docs: list[Obj], kind: str) -> list[Obj]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = [d for d in objects(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"{len(found)} {kind} named {name}: {[d['metadata']['name'] for d in objects(docs, kind)]}"
    return found[0]


def container(workload: Obj) -> Obj:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def env(c: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in c.get("env", [])}


def secret_ref(c: Obj, name: str) -> tuple[str, str]:
    ref = env(c)[name]["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


def pod_templates(docs: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    for d in docs:
        if d["kind"] in ("StatefulSet", "DaemonSet"):
            yield d, d["spec"]["template"]


@functools.cache
def crd_validator(file: str) -> Any:
    schema = json.loads((SCHEMAS / file).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def crd_errors(obj: Obj) -> list[str]:
    validator = crd_validator(CRD_SCHEMAS[(obj["apiVersion"], obj["kind"])])
    return [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(obj)]
