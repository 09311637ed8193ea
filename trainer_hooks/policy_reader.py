"""The controller's policy as a rank sees it: a reader of the policy the node agent publishes, in the policy file
(``$OPSD_POLICY_FILE``) or, for a pod with no host directory, at the agent's ``/v1/policy`` (the agent at
``$OPSD_AGENT_HOST``: ``opsd.protocol.node_agent``); its format is ``opsd.protocol.policy_file``.

    reader = PolicyReader(policy_source())
    ...
    if reader.current().checkpoint_due(step):
        save_checkpoint(step)
    for command in reader.new_commands(rank):
        run(command)

The file is replaced atomically by the agent; the reader looks at it at most every ``check_every_s`` (one
``stat``), parses it only when it changed. The agent's URL is fetched every ``check_every_s`` by a thread of the
reader's own, never by the caller (the training thread asks at every step and must not wait on the network). Either
way the reader keeps the last good policy when a new one is malformed or cannot be had (counting ``errors``), and
never raises.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping

from opsd.protocol.env import POLICY_FILE_ENV
from opsd.protocol.policy_file import EMPTY, Command, Policy, PolicyError, decode_policy
from trainer_hooks.sinks import agent_from_env, rank_headers

log = logging.getLogger(__name__)


def policy_source(path: str | None = None, environ: Mapping[str, str] = os.environ) -> str | None:
    """Where the rank reads the policy: ``path``, else ``$OPSD_POLICY_FILE``, else the URL of the agent at
    ``$OPSD_AGENT_HOST``; None when there is none."""
    found = path or environ.get(POLICY_FILE_ENV)
    if found:
        return found
    address = agent_from_env(environ)
    return address.policy_url if address is not None else None


class PolicyReader:
    def __init__(
        self,
        path: str | None,
        *,
        check_every_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        timeout_s: float = 2.0,
    ) -> None:
        """``path``: the policy file, or the agent's policy URL (``http://...``)."""
        self.path = path
        self.check_every_s = check_every_s
        self.timeout_s = timeout_s
        self.errors = 0
        self._clock = clock
        self._checked: float | None = None
        self._signature: tuple[int, int] | None = None
        self._policy = EMPTY
        self._done: set[str] = set()
        self._fetched: bytes | None = None
        self._warned = False
        self._stop = threading.Event()
        if path is not None and path.startswith(("http://", "https://")):
            threading.Thread(target=self._fetch_forever, name="opsd-policy-reader", daemon=True).start()

    @property
    def remote(self) -> bool:
        return self.path is not None and self.path.startswith(("http://", "https://"))

    def current(self) -> Policy:
        """The policy in force (an empty one until a valid one appears)."""
        if self.path is None or self.remote:
            return self._policy
        now = self._clock()
        if self._checked is not None and now - self._checked < self.check_every_s:
            return self._policy
        self._checked = now
        try:
            stat = os.stat(self.path)
            signature = (stat.st_mtime_ns, stat.st_size)
            if signature == self._signature:
                return self._policy
            self._signature = signature  # a bad file is reported once, not at every check
            with open(self.path, "rb") as f:
                self._policy = decode_policy(f.read())
        except FileNotFoundError:
            pass
        except (OSError, PolicyError) as exc:
            self.errors += 1
            log.warning("policy file %s ignored, keeping the last good policy: %s", self.path, exc)
        return self._policy

    def fetch_once(self) -> None:
        """Read the agent's policy once (the reader's thread does it every ``check_every_s``)."""
        assert self.path is not None
        try:
            request = urllib.request.Request(self.path, headers=rank_headers())  # the run's key, when it has one
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                data = answer.read(1 << 20)
        except (OSError, ValueError) as exc:
            self.errors += 1
            if not self._warned:
                self._warned = True
                log.warning("policy at %s unavailable, keeping the last good policy: %s", self.path, exc)
            return
        if data == self._fetched:
            return
        self._fetched = data  # a bad policy is reported once, not at every fetch
        try:
            self._policy = decode_policy(data)  # one assignment: the training thread sees the old policy or the new
        except PolicyError as exc:
            self.errors += 1
            log.warning("policy at %s ignored, keeping the last good policy: %s", self.path, exc)

    def _fetch_forever(self) -> None:
        while not self._stop.is_set():
            try:
                self.fetch_once()
            except Exception:  # the reader never takes the rank down
                self.errors += 1
                log.exception("policy reader failed")
            self._stop.wait(self.check_every_s)

    def close(self) -> None:
        self._stop.set()

    def new_commands(self, rank: int) -> list[Command]:
        """Commands for ``rank`` not returned before (each command id runs once per process)."""
        out = []
        for command in self.current().commands or ():
            if command.id in self._done or (command.ranks is not None and rank not in command.ranks):
                continue
            self._done.add(command.id)
            out.append(command)
        return out
