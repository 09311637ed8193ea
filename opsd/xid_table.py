"""The XID table shipped with opsd (``opsd/data/xid_actions.csv``), or one of the operator's."""

from __future__ import annotations

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
