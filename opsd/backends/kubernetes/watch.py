"""A list-and-watch cache of one kind of object (an informer, as client-go calls it): what the controller reads of
the cluster without asking the API server at every pass.

It lists the objects, then watches from the list's resourceVersion with bookmarks asked for (the server sends one
now and then, so a quiet watch still moves its resourceVersion on), opens the watch again from the newest
resourceVersion seen when it ends (``watch_timeout_s``), and lists again when the server answers 410 Gone (that
resourceVersion is too old: the changes in between are lost, a fresh list has them). A failed call is retried
after a backoff; ``synced`` is set once a first list is in. It runs on a thread of its own until ``stop``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from opsd.backends.kubernetes.api import Json, KubeApi
from opsd.errors import OpsError

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0


def key_of(obj: Json) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


class Informer:
    def __init__(
        self,
        api: KubeApi,
        kind: str,
        list_: Callable[[], tuple[list[Json], str]],
        *,
        timeout_s: int = 300,
        on_change: Callable[[], None] | None = None,
        keep: Callable[[Json], bool] | None = None,
        **selectors: str,
    ) -> None:
        """``keep``: which of the objects listed and watched the cache holds (what ``selectors`` cannot select on
        the server: the nodes of label selectors ORed); an object that stops being kept leaves it."""
        self.api = api
        self.kind = kind
        self._list = list_
        self.timeout_s = timeout_s
        self.on_change = on_change
        self.selectors = selectors
        self.keep = keep or (lambda _: True)
        self.items: dict[str, Json] = {}
        self.resource_version = ""
        self.synced = threading.Event()
        self.relists = 0  # lists after the first (a 410, or a failed watch)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def objects(self) -> list[Json]:
        with self._lock:
            return list(self.items.values())

    def get(self, key: str) -> Json | None:
        """The object of ``key`` (``namespace/name``; ``/name`` for a cluster-scoped one) in the cache, if any."""
        with self._lock:
            return self.items.get(key)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"opsd-watch-{self.kind}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        failures = 0
        listed = False
        while not self._stop.is_set():
            try:
                if not listed:
                    self.relist()
                    listed, failures = True, 0
                listed = self._watch()
            except OpsError as exc:
                if self._stop.is_set():
                    return  # stopped while its watch was open: the error is the server going away
                failures += 1
                listed = False
                delay = min(MAX_BACKOFF_S, 0.5 * 2 ** min(failures, 6))
                log.warning("%s: %s; listing again in %.1f s", self.kind, exc, delay)
                self._stop.wait(delay)

    def relist(self) -> None:
        """List the objects now (the cache replaced whole)."""
        items, version = self._list()
        with self._lock:
            if self.synced.is_set():
                self.relists += 1
            self.items = {key_of(o): o for o in items if self.keep(o)}
            self.resource_version = version
        self.synced.set()
        self._changed()

    def _watch(self) -> bool:
        """Follow the changes until the watch ends; False when the objects must be listed again (410)."""
        for event in self.api.watch(self.kind, self.resource_version, self.timeout_s, **self.selectors):
            if self._stop.is_set():
                return True
            kind, obj = event["type"], event["object"]
            if kind == "ERROR":
                code = int((obj or {}).get("code", 0))
                log.info("%s: watch from %s answered %s: listing again", self.kind, self.resource_version, code)
                return False  # 410 Gone (or another error): what changed in between is only in a fresh list
            version = str((obj.get("metadata") or {}).get("resourceVersion", ""))
            with self._lock:
                if kind in ("ADDED", "MODIFIED") and self.keep(obj):
                    self.items[key_of(obj)] = obj
                elif kind in ("ADDED", "MODIFIED", "DELETED"):
                    self.items.pop(key_of(obj), None)
                if version:
                    self.resource_version = version
            if kind != "BOOKMARK":
                self._changed()
        return True

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:
                log.exception("%s: a change could not be handled", self.kind)


class AllSynced:
    """Set once every one of ``events`` is (what ``InformerSet.synced`` is)."""

    def __init__(self, events: Sequence[threading.Event]) -> None:
        self.events = events

    def is_set(self) -> bool:
        return all(e.is_set() for e in self.events)

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for event in self.events:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not event.wait(left):
                return False
        return True


class InformerSet:
    """Informers of one kind in several namespaces, read as one cache (the runs' pods and JobSets where the
    controller may read them: its Roles in a list of namespaces)."""

    def __init__(self, kind: str, parts: Sequence[Informer]) -> None:
        self.kind = kind
        self.parts = list(parts)
        self.synced = AllSynced([p.synced for p in self.parts])

    @property
    def relists(self) -> int:
        return sum(p.relists for p in self.parts)

    def objects(self) -> list[Json]:
        return [o for p in self.parts for o in p.objects()]

    def get(self, key: str) -> Json | None:
        for part in self.parts:
            found = part.get(key)
            if found is not None:
                return found
        return None

    def relist(self) -> None:
        for part in self.parts:
            part.relist()

    def start(self) -> None:
        for part in self.parts:
            part.start()

    def stop(self) -> None:
        for part in self.parts:
            part.stop()


Cache = Informer | InformerSet  # what the reconciler and the backend read
