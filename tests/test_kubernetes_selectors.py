"""The nodes opsd manages as label selectors ORed (opsd.backends.kubernetes.selectors): a table of named cases of
the API server's label selector syntax, and the terms ORed."""

from __future__ import annotations

import pytest

from opsd.backends.kubernetes.config import KubernetesConfig
from opsd.backends.kubernetes.selectors import NodeSelector

GPU_OPERATOR = {"nvidia.com/gpu.present": "true"}
GKE = {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
NFD = {"feature.node.kubernetes.io/pci-10de.present": "true"}
KARPENTER = {"karpenter.k8s.aws/instance-gpu-manufacturer": "nvidia"}
CPU = {"kubernetes.io/os": "linux"}
PLATFORMS = (
    "nvidia.com/gpu.present=true; cloud.google.com/gke-accelerator;"
    " feature.node.kubernetes.io/pci-10de.present=true; karpenter.k8s.aws/instance-gpu-manufacturer=nvidia"
)

CASES = {
    "empty: every node": ("", CPU, True),
    "equals": ("nvidia.com/gpu.present=true", GPU_OPERATOR, True),
    "equals, other value": ("nvidia.com/gpu.present=false", GPU_OPERATOR, False),
    "double equals": ("nvidia.com/gpu.present==true", GPU_OPERATOR, True),
    "not equals, label absent": ("nvidia.com/gpu.present!=true", CPU, True),
    "not equals, label equal": ("nvidia.com/gpu.present!=true", GPU_OPERATOR, False),
    "exists": ("cloud.google.com/gke-accelerator", GKE, True),
    "exists, absent": ("cloud.google.com/gke-accelerator", CPU, False),
    "does not exist": ("!cloud.google.com/gke-accelerator", CPU, True),
    "in": ("karpenter.k8s.aws/instance-gpu-manufacturer in (nvidia, amd)", KARPENTER, True),
    "in, other value": ("karpenter.k8s.aws/instance-gpu-manufacturer in (amd)", KARPENTER, False),
    "notin": ("karpenter.k8s.aws/instance-gpu-manufacturer notin (amd)", KARPENTER, True),
    "requirements ANDed": ("nvidia.com/gpu.present=true,kubernetes.io/os=linux", GPU_OPERATOR, False),
    "requirements ANDed, both hold": (
        "nvidia.com/gpu.present=true,kubernetes.io/os=linux",
        {**GPU_OPERATOR, **CPU},
        True,
    ),
    "a set's commas are not requirements'": ("a in (x,y),b", {"a": "y", "b": ""}, True),
    "terms ORed: GPU Operator": (PLATFORMS, GPU_OPERATOR, True),
    "terms ORed: GKE": (PLATFORMS, GKE, True),
    "terms ORed: NFD": (PLATFORMS, NFD, True),
    "terms ORed: Karpenter": (PLATFORMS, KARPENTER, True),
    "terms ORed: a CPU node": (PLATFORMS, CPU, False),
}


@pytest.mark.parametrize(("text", "labels", "matches"), list(CASES.values()), ids=list(CASES))
def test_a_node_matches_as_the_api_server_would_select_it(text: str, labels: dict[str, str], matches: bool) -> None:
    assert NodeSelector.parse(text).matches(labels) is matches


@pytest.mark.parametrize(
    ("text", "server_side"),
    [
        pytest.param("", "", id="every node"),
        pytest.param("nvidia.com/gpu.present=true", "nvidia.com/gpu.present=true", id="one term: the server selects"),
        pytest.param(" a=b ; ", "a=b", id="one term among blanks"),
        pytest.param(PLATFORMS, "", id="terms ORed: every node listed, matched here"),
    ],
)
def test_what_the_api_server_selects(text: str, server_side: str) -> None:
    assert NodeSelector.parse(text).server_side == server_side


@pytest.mark.parametrize("text", ["a=b=c", "a in b", "=x", "a, ,b", "a in (x"])
def test_a_selector_that_is_not_one_is_refused_by_the_config(text: str) -> None:
    with pytest.raises(ValueError, match=r"kubernetes\.node_selector: not a label selector requirement"):
        KubernetesConfig(node_selector=text)
