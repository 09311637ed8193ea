"""The chart's credentials made once: ``python -m opsd.backends.kubernetes.credentials --namespace NS --secret NAME
--generation N``, what the chart's pre-install and pre-upgrade hook Job runs when no token is given (docs/kubernetes.md,
"Credentials").

The Secret holds a random token per role of the controller's API (``opsd.api.auth``): ``operator``, ``reader``,
``agent``, ``metrics``; and ``ranks``, the secret the runs' keys derive from (never rotated by a generation). Made when
missing; a token missing from it is added; nothing else is ever changed, so that every render and every upgrade leaves
the tokens as they are (no token is in the chart's manifests: ``helm template`` and Argo CD render the same thing
twice). A ``generation`` higher than the Secret's (its annotation ``opsd.io/credentials-generation``) replaces every
token: the chart puts the generation in the pods' annotations, which rolls them onto the new tokens. The tokens
replaced stay in the Secret as ``<role>-previous``, which the controller and the agents take beside the new ones until
the next rotation: a pod that has not rolled yet (an agent that still sends the old token, a Prometheus or an operator
that read the new one before a pod rolled) is not refused.

The Secret is in no manifest, so GitOps tools must leave it alone: it never carries ``app.kubernetes.io/instance``
(the label Argo CD tracks its applications' resources by, and prunes those it does not render; one left by an
older chart is removed), and it is annotated not to be pruned and not to count as out of sync
(``ARGO_ANNOTATIONS``), which holds with annotation tracking too.
"""

from __future__ import annotations

import argparse
import base64
import logging
import secrets
import sys
from collections.abc import Sequence

from opsd.backends.kubernetes.api import ConflictError, Json, KubeApi, connect
from opsd.errors import NotFoundError, OpsError
from opsd.protocol.states import ApiRole

log = logging.getLogger(__name__)

ROLES = tuple(ApiRole)
#: the ranks' secret, from which each run's key derives (``opsd.protocol.rank_auth``): made once, never rotated by a
#: generation (the running pods hold keys derived from it)
RANKS = "ranks"
PREVIOUS = "-previous"  # the key of a role's token before the last rotation: ``reader-previous``
GENERATION_ANNOTATION = "opsd.io/credentials-generation"
TRACKING_LABEL = "app.kubernetes.io/instance"  # Argo CD's, by default: never on this Secret
ARGO_ANNOTATIONS = {
    "argocd.argoproj.io/sync-options": "Prune=false",
    "argocd.argoproj.io/compare-options": "IgnoreExtraneous",
}
ATTEMPTS = 5


def token() -> str:
    return secrets.token_urlsafe(32)


def _generation(secret: Json) -> int:
    text = ((secret.get("metadata") or {}).get("annotations") or {}).get(GENERATION_ANNOTATION, "0")
    return int(text) if str(text).isdigit() else 0


def _data(tokens: dict[str, str]) -> dict[str, str]:
    return {role: base64.b64encode(value.encode()).decode() for role, value in tokens.items()}


def _metadata_kept(metadata: Json, labels: dict[str, str]) -> bool:
    """Set ``labels`` and ``ARGO_ANNOTATIONS`` on a Secret's metadata and take ``TRACKING_LABEL`` off; whether it
    already was so."""
    found_labels = metadata.setdefault("labels", {}) or {}
    found_annotations = metadata.setdefault("annotations", {}) or {}
    wanted_labels = {k: v for k, v in {**found_labels, **labels}.items() if k != TRACKING_LABEL}
    wanted_annotations = {**found_annotations, **ARGO_ANNOTATIONS}
    kept = wanted_labels == found_labels and wanted_annotations == found_annotations
    metadata["labels"], metadata["annotations"] = wanted_labels, wanted_annotations
    return kept


def ensure(api: KubeApi, namespace: str, name: str, generation: int, labels: dict[str, str] | None = None) -> str:
    """Make the Secret, fill it, or rotate it: ``created``, ``completed`` (tokens added), ``rotated``, ``relabelled``
    (its labels and annotations set as a GitOps tool must find them, its tokens kept) or ``kept``."""
    if generation < 1:
        raise ValueError("generation must be >= 1")
    labels = {k: v for k, v in (labels or {}).items() if k != TRACKING_LABEL}
    for _ in range(ATTEMPTS):
        try:
            found = api.secret(namespace, name)
        except NotFoundError:
            secret = {
                "apiVersion": "v1",
                "kind": "Secret",
                "type": "Opaque",
                "metadata": {
                    "name": name,
                    "namespace": namespace,
                    "labels": dict(labels),
                    "annotations": {GENERATION_ANNOTATION: str(generation), **ARGO_ANNOTATIONS},
                },
                "data": _data({role: token() for role in (*ROLES, RANKS)}),
            }
            try:
                api.create_secret(namespace, secret)
            except ConflictError:
                continue  # made meanwhile (a second hook): read it
            return "created"
        data = dict(found.get("data") or {})
        metadata_kept = _metadata_kept(found.setdefault("metadata", {}), labels)
        if _generation(found) < generation:
            previous = {role + PREVIOUS: data[role] for role in ROLES if data.get(role)}
            kept = {RANKS: data[RANKS]} if data.get(RANKS) else _data({RANKS: token()})
            outcome, data = "rotated", {**_data({role: token() for role in ROLES}), **previous, **kept}
        elif all(data.get(role) for role in (*ROLES, RANKS)):
            if metadata_kept:
                return "kept"
            outcome = "relabelled"
        else:
            outcome = "completed"
            data.update(_data({role: token() for role in (*ROLES, RANKS) if not data.get(role)}))
        found["data"] = data
        found.setdefault("metadata", {}).setdefault("annotations", {})[GENERATION_ANNOTATION] = str(
            max(generation, _generation(found))
        )
        try:
            api.replace_secret(namespace, found)
        except ConflictError:
            continue
        return outcome
    raise OpsError(f"secret {namespace}/{name} kept changing: {ATTEMPTS} conflicting writes")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--secret", required=True, help="the Secret's name")
    parser.add_argument("--generation", type=int, default=1, help="raise it to replace every token")
    parser.add_argument("--label", action="append", default=[], help="KEY=VALUE on a Secret it makes")
    parser.add_argument("--kubeconfig", default="", help="outside a cluster (default: the in-cluster account)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    labels = dict(item.split("=", 1) for item in args.label if "=" in item)
    try:
        outcome = ensure(KubeApi(connect(args.kubeconfig)), args.namespace, args.secret, args.generation, labels)
    except (OpsError, ValueError) as exc:
        print(f"opsd credentials: {exc}", file=sys.stderr)
        return 1
    print(f"secret {args.namespace}/{args.secret}: {outcome} (generation {args.generation})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
