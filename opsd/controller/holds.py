"""Maintenance windows (``opsd maintenance start|stop [--run RUN]``): while one holds a run (or every run), the
controller goes on detecting and recording incidents, and carries out no recovery step; when it ends, the
recoveries held are started. Kept in the state store (table ``holds``): a controller started again, or one that
takes over, holds what its predecessor held.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from sqlalchemy import delete, insert, select, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import OperationalError

from opsd.controller.schema import holds
from opsd.errors import TransientError

EVERY_RUN = ""  # the scope of a window over every run


@dataclass(frozen=True)
class Hold:
    scope: str  # a run, or EVERY_RUN
    reason: str
    since_s: float

    @property
    def run(self) -> str | None:
        return self.scope or None


class Holds:
    """The maintenance windows in force, in the state store's database."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @contextmanager
    def _tx(self) -> Iterator[Connection]:
        try:
            with self.engine.begin() as conn:
                yield conn
        except OperationalError as exc:  # database locked or unreachable: worth retrying
            raise TransientError(f"state store: {exc.orig}", retry_after_s=1.0) from exc

    def start(self, run: str | None, reason: str, now_s: float) -> Hold:
        """Hold ``run`` (None: every run); a window already open keeps its start and takes the new reason."""
        scope = run or EVERY_RUN
        with self._tx() as c:
            found = c.execute(select(holds.c.since_s).where(holds.c.scope == scope)).first()
            if found is None:
                c.execute(insert(holds).values(scope=scope, reason=reason, since_s=now_s))
                since_s = now_s
            else:
                c.execute(update(holds).where(holds.c.scope == scope).values(reason=reason))
                since_s = float(found[0])
        return Hold(scope, reason, since_s)

    def stop(self, run: str | None) -> bool:
        """End the window of ``run`` (None: the one over every run); False when there was none."""
        with self._tx() as c:
            return bool(c.execute(delete(holds).where(holds.c.scope == (run or EVERY_RUN))).rowcount)

    def all(self) -> list[Hold]:
        """Every window in force, the one over every run first."""
        with self._tx() as c:
            rows = c.execute(select(holds).order_by(holds.c.scope)).all()
        return [Hold(str(r.scope), str(r.reason), float(r.since_s)) for r in rows]

    def of(self, run: str) -> Hold | None:
        """The window that holds ``run``: its own, else the one over every run."""
        found = {h.scope: h for h in self.all()}
        return found.get(run) or found.get(EVERY_RUN)
