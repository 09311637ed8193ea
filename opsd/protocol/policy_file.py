"""The policy file: what the controller asks of a run's ranks (docs/protocol.md, "Policy"), as the node agent
writes it (``$OPSD_POLICY_FILE``, from the ``policy`` of the heartbeat's reply) and the ranks read it
(``trainer_hooks.policy_reader``).

The checkpoint cadence is "every K steps from step E": E is chosen by the controller safely in the future, so
every rank, whichever moment its node's file changed, saves at the same steps (a checkpoint is a collective).
Before E, what was in force before applies: the ``previous`` cadence the file names, else the rank's local one
(the same on every rank, since every rank got the same command line). Commands (``dump_flight_recorder``) run once
per id on the ranks they name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from opsd.errors import PermanentError

VERSION = 1
#: the command that asks ranks for a Flight Recorder dump (docs/flight-recorder.md)
DUMP_COMMAND = "dump_flight_recorder"


class PolicyError(PermanentError, ValueError):
    """A policy file that does not follow docs/protocol.md."""


@dataclass(frozen=True)
class Command:
    id: str
    name: str  # e.g. "dump_flight_recorder"
    ranks: tuple[int, ...] | None = None  # None: every rank


@dataclass(frozen=True)
class Policy:
    checkpoint_every_steps: int | None = None
    checkpoint_from_step: int = 0
    commands: tuple[Command, ...] = ()
    previous_every_steps: int | None = None  # the cadence in force before checkpoint_from_step, if any
    previous_from_step: int = 0
    checkpoint_at_step: int | None = None  # a one-off checkpoint asked for (a graceful restart), besides the cadence

    def checkpoint_due(self, step: int, local: bool = False) -> bool:
        """Whether to save after ``step``; ``local``: the rank's own cadence's answer, used before any published
        cadence takes effect."""
        if step == self.checkpoint_at_step:
            return True
        every = self.checkpoint_every_steps
        if every is not None and step >= self.checkpoint_from_step:
            return (step - self.checkpoint_from_step) % every == 0
        before = self.previous_every_steps
        if before is not None and step >= self.previous_from_step:
            return (step - self.previous_from_step) % before == 0
        return local


def _int(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PolicyError(f"policy.{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _cadence(value: Any, name: str) -> tuple[int, int]:
    """``{"every_steps": K, "from_step": E}`` at ``policy.<name>`` -> (K, E)."""
    if not isinstance(value, dict):
        raise PolicyError(f"policy.{name} must be an object")
    every = _int(value.get("every_steps"), f"{name}.every_steps", 1)
    return every, _int(value.get("from_step", 0), f"{name}.from_step", 0)


def parse_policy(data: bytes) -> Policy:
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise PolicyError(f"policy is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("v") != 1:
        raise PolicyError("policy must be a JSON object with v = 1")
    every: int | None = None
    before: int | None = None
    start = before_start = 0
    cadence = doc.get("checkpoint")
    if cadence is not None:
        every, start = _cadence(cadence, "checkpoint")
        if cadence.get("previous") is not None:
            before, before_start = _cadence(cadence["previous"], "checkpoint.previous")
    commands = []
    raw = doc.get("commands", [])
    if not isinstance(raw, list):
        raise PolicyError("policy.commands must be a list")
    for c in raw:
        if not (isinstance(c, dict) and isinstance(c.get("id"), str) and isinstance(c.get("name"), str)):
            raise PolicyError("policy.commands entries need string id and name")
        ranks = c.get("ranks")
        if ranks is not None and not (isinstance(ranks, list) and all(isinstance(r, int) for r in ranks)):
            raise PolicyError("policy.commands[].ranks must be a list of ranks")
        commands.append(Command(c["id"], c["name"], tuple(ranks) if ranks is not None else None))
    at = doc.get("checkpoint_at_step")
    at_step = _int(at, "checkpoint_at_step", 1) if at is not None else None
    return Policy(every, start, tuple(commands), before, before_start, at_step)
