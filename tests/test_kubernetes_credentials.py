"""The chart's credentials made once (opsd.backends.kubernetes.credentials), on the emulated API server: a random
token per role when the Secret is missing, nothing changed when it is there, the missing ones added, every one
replaced for a higher generation; and the chart's hook Job runs exactly this, with the arguments it renders."""

from __future__ import annotations

import base64
from pathlib import Path

from opsd.backends.kubernetes.api import Json, KubeApi
from opsd.backends.kubernetes.credentials import (
    ARGO_ANNOTATIONS,
    GENERATION_ANNOTATION,
    PREVIOUS,
    RANKS,
    ROLES,
    ensure,
    main,
)
from tests.kube.emulator import KubeEmulator
from tests.kube.training import kubeconfig


def tokens(kube: KubeEmulator, name: str = "opsd-credentials") -> dict[str, str]:
    secret = kube.get("secrets", "opsd", name)
    assert secret is not None
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def test_made_once_kept_completed_and_rotated(kube: KubeEmulator) -> None:
    kube.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "opsd"}})
    api = KubeApi(kube.api_client)
    assert ensure(api, "opsd", "opsd-credentials", 1, {"app.kubernetes.io/part-of": "opsd"}) == "created"
    made = tokens(kube)
    assert set(made) == {*ROLES, RANKS}
    assert len(set(made.values())) == 5
    assert all(len(t) >= 40 for t in made.values())
    assert ensure(api, "opsd", "opsd-credentials", 1) == "kept"  # every install and upgrade after the first
    assert tokens(kube) == made
    secret = kube.get("secrets", "opsd", "opsd-credentials")
    assert secret is not None
    del secret["data"]["metrics"]  # a Secret of an older chart, without one role
    del secret["data"][RANKS]  # nor the ranks' secret
    kube.put(secret)
    assert ensure(api, "opsd", "opsd-credentials", 1) == "completed"
    completed = tokens(kube)
    new = ("metrics", RANKS)
    assert {k: v for k, v in completed.items() if k not in new} == {k: v for k, v in made.items() if k not in new}
    assert completed["metrics"] not in made.values()
    assert completed[RANKS] not in made.values()
    assert ensure(api, "opsd", "opsd-credentials", 2) == "rotated"
    rotated = tokens(kube)
    current = {role: rotated[role] for role in ROLES}
    assert not set(current.values()) & set(completed.values())
    # the tokens replaced are kept as the previous ones, taken beside the new until the next rotation; the ranks'
    # secret is not rotated (the running pods hold keys derived from it)
    assert {role: rotated[role + PREVIOUS] for role in ROLES} == {k: v for k, v in completed.items() if k != RANKS}
    assert rotated[RANKS] == completed[RANKS]
    after = kube.get("secrets", "opsd", "opsd-credentials")
    assert after is not None
    assert after["metadata"]["annotations"][GENERATION_ANNOTATION] == "2"
    assert ensure(api, "opsd", "opsd-credentials", 1) == "kept"  # an older generation changes nothing
    assert ensure(api, "opsd", "opsd-credentials", 3) == "rotated"
    again = tokens(kube)
    assert {role: again[role + PREVIOUS] for role in ROLES} == current  # the oldest ones are no longer taken
    assert len(again) == 2 * len(ROLES) + 1
    assert again[RANKS] == completed[RANKS]


def test_the_command_line_of_the_hook(kube: KubeEmulator, tmp_path: Path) -> None:
    kube.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "opsd"}})
    config = str(kubeconfig(kube, tmp_path / "kubeconfig"))
    args = ["--namespace", "opsd", "--secret", "made", "--generation", "3", "--label", "app.kubernetes.io/part-of=opsd"]
    assert main([*args, "--kubeconfig", config]) == 0
    made = kube.get("secrets", "opsd", "made")
    assert made is not None
    assert made["metadata"]["labels"] == {"app.kubernetes.io/part-of": "opsd"}
    assert main(["--namespace", "nowhere", "--secret", "x", "--kubeconfig", config]) == 1  # a clear error, exit 1


def argo_prunes(secret: Json, application: str) -> bool:
    """Whether Argo CD, tracking its application's resources by label (its default), prunes ``secret``, which it
    does not render: it carries the application's instance label and is not annotated ``Prune=false``."""
    meta = secret["metadata"]
    tracked = (meta.get("labels") or {}).get("app.kubernetes.io/instance") == application
    kept = "Prune=false" in (meta.get("annotations") or {}).get("argocd.argoproj.io/sync-options", "")
    return tracked and not kept


def test_the_secret_survives_an_argo_cd_prune_and_one_of_an_older_chart_is_relabelled(kube: KubeEmulator) -> None:
    kube.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "opsd"}})
    api = KubeApi(kube.api_client)
    labels = {"app.kubernetes.io/part-of": "opsd", "app.kubernetes.io/instance": "opsd"}  # as an older hook passed
    assert ensure(api, "opsd", "opsd-credentials", 1, labels) == "created"
    made = kube.get("secrets", "opsd", "opsd-credentials")
    assert made is not None
    assert not argo_prunes(made, "opsd")
    assert made["metadata"]["labels"] == {"app.kubernetes.io/part-of": "opsd"}
    # a Secret an older chart's hook made: tracked by Argo CD, which would prune it at the next sync
    made["metadata"]["labels"]["app.kubernetes.io/instance"] = "opsd"
    for key in ARGO_ANNOTATIONS:
        del made["metadata"]["annotations"][key]
    kube.put(made)
    older = kube.get("secrets", "opsd", "opsd-credentials")
    assert older is not None
    assert argo_prunes(older, "opsd")
    assert ensure(api, "opsd", "opsd-credentials", 1, {"app.kubernetes.io/part-of": "opsd"}) == "relabelled"
    after = kube.get("secrets", "opsd", "opsd-credentials")
    assert after is not None
    assert not argo_prunes(after, "opsd")
    assert after["data"] == older["data"]  # the tokens kept
    assert ensure(api, "opsd", "opsd-credentials", 1, {"app.kubernetes.io/part-of": "opsd"}) == "kept"
