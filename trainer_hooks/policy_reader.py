"""The controller's policy as a rank sees it: a reader of the policy file the node agent writes
(``$OPSD_POLICY_FILE``; its format is ``opsd.protocol.policy_file``).

    reader = PolicyReader(os.environ["OPSD_POLICY_FILE"])
    ...
    if reader.current().checkpoint_due(step):
        save_checkpoint(step)
    for command in reader.new_commands(rank):
        run(command)

The file is replaced atomically by the agent; the reader looks at it at most every ``check_every_s`` (one
``stat``), parses it only when it changed, keeps the last good policy when a new one is malformed (counting
``errors``), and never raises.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from opsd.protocol.policy_file import Command, Policy, PolicyError, parse_policy

log = logging.getLogger(__name__)


class PolicyReader:
    def __init__(
        self, path: str | None, *, check_every_s: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.path = path
        self.check_every_s = check_every_s
        self.errors = 0
        self._clock = clock
        self._checked: float | None = None
        self._signature: tuple[int, int] | None = None
        self._policy = Policy()
        self._done: set[str] = set()

    def current(self) -> Policy:
        """The policy in force (an empty one until a valid file appears)."""
        now = self._clock()
        if self.path is None or (self._checked is not None and now - self._checked < self.check_every_s):
            return self._policy
        self._checked = now
        try:
            stat = os.stat(self.path)
            signature = (stat.st_mtime_ns, stat.st_size)
            if signature == self._signature:
                return self._policy
            self._signature = signature  # a bad file is reported once, not at every check
            with open(self.path, "rb") as f:
                self._policy = parse_policy(f.read())
        except FileNotFoundError:
            pass
        except (OSError, PolicyError) as exc:
            self.errors += 1
            log.warning("policy file %s ignored, keeping the last good policy: %s", self.path, exc)
        return self._policy

    def new_commands(self, rank: int) -> list[Command]:
        """Commands for ``rank`` not returned before (each command id runs once per process)."""
        out = []
        for command in self.current().commands:
            if command.id in self._done or (command.ranks is not None and rank not in command.ranks):
                continue
            self._done.add(command.id)
            out.append(command)
        return out
