"""The XID table shipped with opsd (``opsd/data/xid_actions.csv``), or one of the operator's."""

from __future__ import annotations

import csv
import io
from importlib import resources
from pathlib import Path

from opsd.errors import ConfigError
from opsd.policy.xid import XidAction, parse_table


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
