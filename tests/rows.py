"""Reading the state store's rows in tests."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def stored(row: T | None) -> T:
    """The row the store answered; a test fails here when there was none."""
    assert row is not None, "no such row in the state store"
    return row
