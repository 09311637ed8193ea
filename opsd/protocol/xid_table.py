"""The XID table: what each NVIDIA XID calls for (``xid,meaning,default_action`` CSV), the one shipped with opsd
(``opsd/data/xid_actions.csv``) or one of the operator's. ``opsd.policy.xid`` decides with it."""

from __future__ import annotations

import csv
import io
from enum import StrEnum
from importlib import resources
from pathlib import Path

from opsd.errors import ConfigError


class XidAction(StrEnum):
    CORDON_AND_SWAP = "cordon_and_swap"
    RESTART_JOB = "restart_job"
    WATCH_WINDOW = "watch_window"


#: a GPU event's action when the agent only counted it (a ``watch_window`` XID within its budget)
COUNTED = "count"


def parse_table(text: str) -> dict[int, XidAction]:
    """The ``xid,meaning,default_action`` CSV as a mapping; raises ValueError naming the bad line."""
    table: dict[int, XidAction] = {}
    reader = csv.DictReader(io.StringIO(text))
    if reader.fieldnames is None or not {"xid", "default_action"} <= set(reader.fieldnames):
        raise ValueError("xid table: the header must name the columns xid and default_action")
    for line, row in enumerate(reader, start=2):
        try:
            table[int(row["xid"])] = XidAction(row["default_action"].strip())
        except (ValueError, TypeError, AttributeError):
            raise ValueError(f"xid table line {line}: bad xid or action {row!r}") from None
    return table


def load_xid_table(path: str | Path | None = None) -> dict[int, XidAction]:
    """The default table, or the CSV at ``path``; raises ConfigError naming the file and the problem."""
    try:
        if path is None:
            text = resources.files("opsd").joinpath("data/xid_actions.csv").read_text()
        else:
            text = Path(path).read_text()
        return parse_table(text)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"xid table {path or 'opsd/data/xid_actions.csv'}: {exc}") from None


def xid_meanings(path: str | Path | None = None) -> dict[int, dict[str, str]]:
    """``{xid: {"meaning", "action"}}`` from the table (the post-mortem names what an XID means)."""
    try:
        if path is None:
            text = resources.files("opsd").joinpath("data/xid_actions.csv").read_text()
        else:
            text = Path(path).read_text()
        actions = parse_table(text)
        rows = csv.DictReader(io.StringIO(text))
        return {
            int(row["xid"]): {"meaning": row.get("meaning") or "", "action": actions[int(row["xid"])].value}
            for row in rows
        }
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"xid table {path or 'opsd/data/xid_actions.csv'}: {exc}") from None
