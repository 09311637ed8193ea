"""Each run's key in a Secret of its JobSet's namespace, for its pods' ``$OPSD_RANK_KEY`` (docs/kubernetes.md, "The
run's key"; ``opsd.protocol.rank_auth``): ``opsd-rank-key-<run>``, key ``key``, owned by the JobSet (deleted with
it). The leader makes it when it finds the run; a Secret of that name that is there already is left as it is (the key
is the same for the same run). The controller needs only ``create`` on Secrets there: it never reads them.
"""

from __future__ import annotations

import base64
import logging

from opsd.backends.kubernetes.api import ConflictError, Json, KubeApi
from opsd.backends.kubernetes.cluster import JOBSET_GROUP, JOBSET_VERSION, RUN_ANNOTATION, rank_key_secret
from opsd.errors import OpsError
from opsd.protocol.rank_auth import run_key

log = logging.getLogger(__name__)


class RankKeys:
    def __init__(self, api: KubeApi, secret: str) -> None:
        """``secret``: the ranks' secret ("": no keys are made)."""
        self.api, self.secret = api, secret
        self.made: set[tuple[str, str, str]] = set()  # (namespace, run, the JobSet's uid): made or found
        self.failed: set[tuple[str, str, str]] = set()  # told once

    def ensure(self, run: str, jobset: Json) -> None:
        """Make ``run``'s Secret beside its JobSet, once per JobSet."""
        if not self.secret:
            return
        meta = jobset.get("metadata") or {}
        namespace, uid = str(meta.get("namespace") or ""), str(meta.get("uid") or "")
        which = (namespace, run, uid)
        if which in self.made or not namespace:
            return
        jobset_api = f"{JOBSET_GROUP}/{JOBSET_VERSION}"
        owner = [{"apiVersion": jobset_api, "kind": "JobSet", "name": meta.get("name"), "uid": uid}]
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "Opaque",
            "metadata": {
                "name": rank_key_secret(run),
                "namespace": namespace,
                "labels": {"app.kubernetes.io/managed-by": "opsd"},
                "annotations": {RUN_ANNOTATION: run},
                **({"ownerReferences": owner} if uid else {}),
            },
            "data": {"key": base64.b64encode(run_key(self.secret, run).encode()).decode()},
        }
        try:
            self.api.create_secret(namespace, body)
            log.info("run %s: its key in Secret %s/%s", run, namespace, rank_key_secret(run))
        except ConflictError:
            pass  # there already: the same run's, the same key
        except OpsError as exc:
            if which not in self.failed:
                self.failed.add(which)
                log.warning("run %s: its key's Secret could not be made in %s (tried again): %s", run, namespace, exc)
            return
        self.made.add(which)
