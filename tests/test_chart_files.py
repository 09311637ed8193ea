"""The chart's own files and the image it runs: Chart.yaml, values.schema.json strict throughout, yamllint on the
chart's YAML, the chart's copy of the dashboards and rules, the packaged chart rendering alone, the validators the
chart's tests rely on refusing what they should, the Dockerfile, and tools/install_helm.py keeping a helm of the
pinned version."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import tarfile
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml  # type: ignore[import-untyped]
from yamllint import linter as yamllint_linter  # type: ignore[import-untyped]
from yamllint.config import YamlLintConfig  # type: ignore[import-untyped]

from tests.helm_chart import (
    API_ARGS,
    CHART,
    DASHBOARDS,
    JOBSET_EXAMPLE,
    ROOT,
    RULES,
    Helm,
    Obj,
    crd_errors,
    objects,
    one,
    parse,
)

# -- the chart's files -------------------------------------------------------------------------------------------------


def test_chart_metadata() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["apiVersion"] == "v2"
    assert chart["appVersion"] == project["version"] == "0.1.0"
    assert chart["kubeVersion"] == ">=1.29.0-0"


# Kubernetes types the values pass through as they are: the API server (and kubernetes-validate, above) checks them.
PASSED_THROUGH = (
    "/nodeAffinity",
    "/podAffinity",
    "/podAntiAffinity",
    "/httpGet",
    "/tcpSocket",
    "/exec",
    "/grpc",
    "/seLinuxOptions",
    "/seccompProfile",
    "/appArmorProfile",
    "/windowsOptions",
    "/valueFrom",
    "/sysctls/items",
    "/claims/items",
    "/topologySpreadConstraints/items",
    "/podSelector",  # NetworkPolicy peers' label selectors
    "/namespaceSelector",
)
FREE_OBJECTS = (
    "/properties/global",
    "/properties/controller/properties/config",  # opsd validates its own settings
    "/properties/agent/properties/config",
)


def test_values_schema_is_strict_throughout() -> None:
    """Every object of the values schema lists its keys and refuses others, or is a map of typed values; the only
    free objects are the settings maps, `global`, and Kubernetes types passed through."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    loose: list[str] = []

    def walk(node: Any, where: str) -> None:
        if isinstance(node, dict):
            if node.get("type") == "object":
                free = where in FREE_OBJECTS or where.endswith(PASSED_THROUGH)
                if "properties" in node and node.get("additionalProperties") is not False:
                    loose.append(where)  # lists its keys but lets others in
                if "properties" not in node and not isinstance(node.get("additionalProperties"), dict) and not free:
                    loose.append(where)  # takes anything
            for key, sub in node.items():
                walk(sub, f"{where}/{key}")
        elif isinstance(node, list):
            for i, sub in enumerate(node):
                walk(sub, f"{where}/{i}")

    walk(schema, "")
    assert loose == []
    assert schema["additionalProperties"] is False
    jsonschema.Draft202012Validator(schema).validate(yaml.safe_load((CHART / "values.yaml").read_text()))


def test_chart_yaml_passes_yamllint() -> None:
    config = YamlLintConfig(file=str(CHART / ".yamllint"))
    files = [CHART / "Chart.yaml", CHART / "values.yaml", *sorted((CHART / "ci").glob("*.yaml")), JOBSET_EXAMPLE]
    problems = [
        f"{path.relative_to(ROOT)}:{p.line}:{p.column}: {p.message} ({p.rule})"
        for path in files
        for p in yamllint_linter.run(path.read_text(), config, str(path))
    ]
    assert problems == []


def chart_copy() -> dict[str, bytes]:
    """What helm/opsd/files/dashboards must hold: dashboards/*.json and the alert rules, byte for byte."""
    expected = {p.name: p.read_bytes() for p in DASHBOARDS.glob("*.json")}
    expected["rules/opsd.rules.yaml"] = RULES.read_bytes()
    return expected


def test_the_chart_carries_its_own_copy_of_the_dashboards_and_rules() -> None:
    """No link out of the chart: its files are its own, equal to the repository's (`make chart-files` copies them)."""
    files = CHART / "files" / "dashboards"
    assert not [p for p in CHART.rglob("*") if p.is_symlink()]
    copied = {p.relative_to(files).as_posix(): p.read_bytes() for p in files.rglob("*") if p.is_file()}
    assert copied == chart_copy(), "helm/opsd/files/dashboards differs from dashboards/: run `make chart-files`"


def test_the_packaged_chart_renders_alone(helm: Helm, tmp_path: Path) -> None:
    """`helm package`, then the archive alone (copied away from the repository) lints and renders, with the
    dashboards and rules inside it."""
    proc = helm.run("package", "--destination", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    (built,) = (tmp_path / "out").glob("opsd-*.tgz")
    alone = tmp_path / "elsewhere" / built.name
    alone.parent.mkdir()
    shutil.copy(built, alone)
    with tarfile.open(alone) as tar:
        names = tar.getnames()
        packaged = {
            m.name.removeprefix("opsd/files/dashboards/"): tar.extractfile(m).read()  # type: ignore[union-attr]
            for m in tar.getmembers()
            if m.name.startswith("opsd/files/dashboards/") and m.isfile()
        }
    assert packaged == chart_copy()
    assert not [n for n in names if n.endswith((".yamllint", ".test.yaml"))]
    lint = helm.run("lint", "--strict", *API_ARGS, chart=alone)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    proc = helm.template(chart=alone)
    assert proc.returncode == 0, proc.stderr
    docs = parse(proc.stdout)
    assert one(docs, "PrometheusRule")["spec"] == yaml.safe_load(RULES.read_text())
    dashboards = {d["metadata"]["name"] for d in objects(docs, "ConfigMap") if "-dashboard-" in d["metadata"]["name"]}
    assert dashboards == {f"opsd-dashboard-{p.stem}" for p in DASHBOARDS.glob("*.json")}


def test_kubernetes_validate_refuses_unknown_fields() -> None:
    """The strict schemas are really in use: a misspelt field of a built-in object is an error."""
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "x"},
        "spec": {
            "replica": 1,
            "selector": {"matchLabels": {"a": "b"}},
            "template": {"metadata": {"labels": {"a": "b"}}, "spec": {"containers": [{"name": "c", "image": "i"}]}},
        },
    }
    with pytest.raises(kubernetes_validate.ValidationError, match="replica"):
        kubernetes_validate.validate(deployment, "1.37", strict=True)


def test_crd_schemas_refuse_unknown_fields(default: list[Obj]) -> None:
    monitor = json.loads(json.dumps(one(default, "ServiceMonitor")))
    monitor["spec"]["endpoints"][0]["intervall"] = "30s"
    assert any("intervall" in e for e in crd_errors(monitor))
    rule = json.loads(json.dumps(one(default, "PrometheusRule")))
    rule["spec"]["groups"][0]["rules"][0]["for"] = "15 minutes"
    assert crd_errors(rule)


# -- the image ---------------------------------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines = [line for line in (ROOT / "Dockerfile").read_text().splitlines() if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in text.splitlines():
        if line.strip():
            instruction, _, rest = line.strip().partition(" ")
            out.append((instruction.upper(), " ".join(rest.split())))
    return out


def test_dockerfile_base_image_is_pinned() -> None:
    bases = [args.split()[0] for inst, args in dockerfile_instructions() if inst == "FROM"]
    assert bases
    for base in bases:
        assert re.search(r"@sha256:[0-9a-f]{64}$", base) or re.search(r":\d+\.\d+\.\d+[-\w.]*$", base), base


def test_dockerfile_runs_as_a_non_root_user() -> None:
    users = [args for inst, args in dockerfile_instructions() if inst == "USER"]
    assert users, "no USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")
    assert user.isdigit(), "a numeric USER lets Kubernetes check runAsNonRoot"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["controller"]["podSecurityContext"]["runAsUser"] == int(user)
    entrypoints = [args for inst, args in dockerfile_instructions() if inst == "ENTRYPOINT"]
    assert json.loads(entrypoints[-1]) == ["opsd"]


def test_dockerfile_installs_without_torch_and_with_the_makefile_constraints() -> None:
    runs = " ".join(args for inst, args in dockerfile_instructions() if inst == "RUN")
    installs = re.findall(r"pip install ([^&;]*)", runs)
    assert len(installs) == 1, installs
    words = installs[0].split()
    assert '".[agent,controller]"' in words  # the project with the agent's and the controller's extras
    assert not re.search(r"torch|trainer|dev", installs[0]), installs[0]
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not any(dep.lower().startswith("torch") for dep in optional["agent"] + optional["controller"])
    assert "--no-cache-dir" in words
    constraints = words[words.index("-c") + 1]
    make_installs = re.findall(r"pip install .*", (ROOT / "Makefile").read_text())
    make_constraints = {m.split()[m.split().index("-c") + 1] for m in make_installs if " -c " in m}
    assert make_constraints == {constraints} == {"constraints.txt"}
    copied = " ".join(args for inst, args in dockerfile_instructions() if inst == "COPY")
    assert constraints in copied.split()
    assert not {"examples", "bench", "agent"} & set(copied.split())  # the wheel's packages only
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(dep.lower().startswith("torch") for dep in project["dependencies"])


# -- tools/install_helm.py ---------------------------------------------------------------------------------------------


def load_install_helm() -> ModuleType:
    spec = importlib.util.spec_from_file_location("install_helm", ROOT / "tools" / "install_helm.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_install_helm_keeps_a_helm_of_the_pinned_version(helm: Helm, tmp_path: Path) -> None:
    install_helm = load_install_helm()
    version = install_helm.helm_version(Path(helm.path))
    if not install_helm.is_expected(version):
        pytest.skip(f"{helm.path} is {version}, not {install_helm.EXPECTED_VERSION}")
    target = tmp_path / "helm"
    target.symlink_to(helm.path)
    assert "already installed" in install_helm.install(target)
    assert target.is_symlink()  # left alone
    assert not install_helm.is_expected("v3.16.2+g13654a5")
    assert install_helm.is_expected("v4.3.1+gc0d08d0")
