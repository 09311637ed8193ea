"""How the operator's tables are laid out, and the formats of their cells.

A column is one of three kinds (``Fit``). Key columns (ids, names, states, numbers) are never narrower than their
widest line; a table too wide for the terminal takes the room from its one wrapping column. Without ``--wide``, a
free-text column that would be left fewer than ``TEXT_MIN`` cells is left out, and the table's caption says where
to read it. A table that still does not fit is printed wider than the terminal (which wraps its lines), never cut.
Columns marked ``wide`` are shown with ``--wide`` only, those marked ``narrow`` without it, as ``kubectl get -o wide``
does.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import Enum
from typing import Any, Generic, Literal, TypeVar

from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.table import Table
from rich.text import Text

TEXT_MIN = 12  # the narrowest a free-text column gets
TEXT_WIDER = 40  # ... in a table wider than the terminal
WORD_MAX = 48  # a longer word of a wrapping column may be folded
GAP = 3  # cells between two columns


class Fit(Enum):
    KEY = "key"  # ids, names, states, numbers: not wrapped, never narrower than its widest line
    WORDS = "words"  # lists and values: wrapped between words, never inside one (up to WORD_MAX)
    TEXT = "text"  # free text: wrapped and folded, the first to give way


T = TypeVar("T")


@dataclass(frozen=True)
class Col(Generic[T]):
    """A column: its header, its cell of an item of the API's answer, its kind, and when it is shown."""

    header: str
    cell: Callable[[T], str]
    fit: Fit = Fit.KEY
    shown: Literal["always", "narrow", "wide"] = "always"
    elsewhere: str = "left out for want of room (--wide shows it)"  # a free-text column's, when it is left out


PAIR: tuple[Col[tuple[str, str]], ...] = (Col("name", lambda p: p[0]), Col("value", lambda p: p[1], Fit.WORDS))


def listing(title: str, columns: Sequence[Col[T]], items: Iterable[T], *, wide: bool) -> Grid:
    """A table of ``items``, one row each, with the columns of ``wide`` or of the narrow (default) form."""
    chosen = tuple(c for c in columns if c.shown == "always" or (c.shown == "wide") == wide)
    return Grid(title, chosen, [[c.cell(item) for c in chosen] for item in items], wide)


def pairs(title: str, rows: Sequence[tuple[str, str]]) -> Grid:
    """A table of names and values, one pair a row, without headers; a value wraps between its words."""
    return Grid(title, PAIR, [[name, value] for name, value in rows], wide=False, header=False)


@dataclass(frozen=True)
class Grid:
    """A table laid out when it is printed, for the width it is printed at."""

    title: str
    columns: tuple[Col[Any], ...]
    rows: list[list[str]]
    wide: bool
    header: bool = True

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        shown = self.shown(options.max_width)
        needed = sum(self.narrowest(i) for i in shown) + GAP * (len(shown) - 1)
        if needed > options.max_width:  # wider than the terminal anyway: free text gets room enough to read
            needed += sum(self.narrowest(i, TEXT_WIDER) - self.narrowest(i) for i in shown)
        yield from console.render(self.table(shown), options.update_width(max(options.max_width, needed)))

    def shown(self, width: int) -> list[int]:
        """The columns shown at ``width``: all, but free text left fewer than ``TEXT_MIN`` cells (narrow form)."""
        every = list(range(len(self.columns)))
        texts = [i for i in every if self.columns[i].fit is Fit.TEXT]
        others = sum(self.narrowest(i) for i in every if i not in texts)
        room = width - others - GAP * (len(every) - 1)
        if self.wide or room >= TEXT_MIN * len(texts):
            return every
        return [i for i in every if i not in texts]

    def table(self, shown: list[int]) -> Table:
        left_out = [c for i, c in enumerate(self.columns) if i not in shown]
        caption = "; ".join(f"{c.header}: {c.elsewhere}" for c in left_out)
        table = Table(
            title=Text(self.title),
            caption=Text(caption) if caption else None,
            show_header=self.header,
            box=box.SIMPLE_HEAD,  # a rule under the headers, no frame: the room goes to the cells
            show_edge=False,
            pad_edge=False,
        )
        for i in shown:
            column = self.columns[i]
            if column.fit is Fit.KEY:
                table.add_column(column.header, no_wrap=True, min_width=self.narrowest(i))
            else:
                table.add_column(column.header, overflow="fold", min_width=self.narrowest(i))
        for row in self.rows:
            table.add_row(*(Text(row[i]) for i in shown))
        return table

    def narrowest(self, index: int, text_min: int = TEXT_MIN) -> int:
        """How narrow a column gets: a key column's widest line, a wrapping column's longest word (up to
        ``WORD_MAX``), a free-text column ``text_min`` (or its widest line, when narrower)."""
        column = self.columns[index]
        texts = [column.header if self.header else "", *(row[index] for row in self.rows)]
        if column.fit is Fit.WORDS:
            return min(WORD_MAX, max((cell_len(word) for text in texts for word in text.split()), default=1))
        widest = max((cell_len(line) for text in texts for line in text.splitlines()), default=1)
        return widest if column.fit is Fit.KEY else min(widest, text_min)


def echo(renderable: RenderableType, console: Console | None = None) -> None:
    """Print a table whole: a line wider than the terminal is left to the terminal to wrap, not cut."""
    (console or Console()).print(renderable, crop=False)


# -- cells -------------------------------------------------------------------------------------------------------
def when(unix_s: float | None) -> str:
    if unix_s is None:
        return "-"
    return datetime.fromtimestamp(unix_s, UTC).strftime("%Y-%m-%d %H:%M:%S")


def size(nbytes: float | None) -> str:
    if nbytes is None:
        return "-"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(nbytes)


def seconds(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def number(value: object) -> str:
    return "-" if value is None else str(value)


def lines(items: Iterable[str]) -> str:
    """One item a line (a key cell of several names), ``-`` for none."""
    return "\n".join(items) or "-"


def fields(values: dict[str, Any] | None) -> str:
    """``name: value; ...`` of a JSON object (an action's arguments or result)."""
    if not values:
        return "-"
    return "; ".join(f"{name}: {_value(value)}" for name, value in values.items())


def _value(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return ", ".join(_value(v) for v in value) or "[]"
    return json.dumps(value)
