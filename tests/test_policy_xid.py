"""XID classification and the watch window, as tables of named cases."""

from __future__ import annotations

from pathlib import Path

import pytest

from opsd.errors import ConfigError
from opsd.policy.xid import WatchWindow, XidEvent, classify, decide
from opsd.protocol.xid_table import XidAction, load_xid_table, parse_table

TABLE = load_xid_table()
W = WatchWindow(window_s=600, threshold=2)


@pytest.mark.parametrize(
    ("xid", "action"),
    [
        (79, XidAction.CORDON_AND_SWAP),  # fallen off the bus
        (48, XidAction.CORDON_AND_SWAP),  # double-bit ECC
        (13, XidAction.RESTART_JOB),  # graphics engine exception
        (31, XidAction.RESTART_JOB),  # page fault: the application
        (92, XidAction.WATCH_WINDOW),  # high single-bit ECC rate
        (99999, XidAction.WATCH_WINDOW),  # unknown: counted and watched, never ignored
    ],
    ids=["79-off-bus", "48-dbe", "13-engine", "31-page-fault", "92-sbe-rate", "unknown"],
)
def test_classify(xid: int, action: XidAction) -> None:
    assert classify(xid, TABLE) is action


def ev(xid: int, t: float, gpu: int = 0) -> XidEvent:
    return XidEvent(gpu=gpu, xid=xid, time_s=t)


CASES: dict[str, tuple[XidEvent, list[XidEvent], XidAction | None]] = {
    "fatal acts at once": (ev(79, 0), [], XidAction.CORDON_AND_SWAP),
    "application error restarts": (ev(13, 0), [], XidAction.RESTART_JOB),
    "first watch event only counts": (ev(92, 100), [], None),
    "within threshold only counts": (ev(92, 100), [ev(92, 50)], None),
    "over threshold in window escalates": (ev(92, 100), [ev(92, 50), ev(94, 60)], XidAction.CORDON_AND_SWAP),
    "old events fall out of the window": (ev(92, 1000), [ev(92, 50), ev(92, 60)], None),
    "other gpus do not count": (ev(92, 100), [ev(92, 50, gpu=1), ev(92, 60, gpu=1)], None),
    "fatal history does not count": (ev(92, 100), [ev(79, 50), ev(48, 60)], None),
}


@pytest.mark.parametrize("name", CASES)
def test_decide(name: str) -> None:
    event, history, expected = CASES[name]
    decision = decide(event, history, TABLE, W)
    assert (decision.action if decision else None) == expected
    if decision is not None:
        assert str(event.xid) in decision.reason or "watch-window" in decision.reason


def test_shipped_table_has_every_action() -> None:
    assert set(TABLE.values()) == set(XidAction)
    assert len(TABLE) >= 30


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("code,action\n1,restart_job\n", "header must name the columns"),
        ("xid,meaning,default_action\nx,bad,restart_job\n", "line 2"),
        ("xid,meaning,default_action\n13,engine,reboot\n", "line 2"),
    ],
    ids=["header", "xid-not-int", "unknown-action"],
)
def test_bad_table_is_rejected(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_table(text)


def test_bad_table_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no-such\.csv"):
        load_xid_table(tmp_path / "no-such.csv")


@pytest.mark.parametrize(("window_s", "threshold"), [(0, 1), (10, -1)])
def test_watch_window_validates_itself(window_s: float, threshold: int) -> None:
    with pytest.raises(ValueError, match=r"xid\.(window_s|threshold)"):
        WatchWindow(window_s=window_s, threshold=threshold)
