"""The demo's verdict: it passes only when the fault was injected, its incident detected and recovered from, and
the run completed; each shortfall is named (the demo itself runs in tests/test_demo.py)."""

from __future__ import annotations

from typing import Any

import pytest

from opsd.cli.demo import Injector, shortfalls

RECOVERED = {"state": "completed", "incident": "fatal_xid", "recovered": True, "final_step": 80}


def injector(injected: bool) -> Injector:
    done = Injector("file:///nonexistent-demo-ckpt", after_checkpoint=20, node="node-1")
    done.injected_s = 1000.0 if injected else None
    return done


CASES: dict[str, tuple[bool, dict[str, Any], list[str]]] = {
    "injected, detected, recovered, completed": (True, {}, []),
    "nothing injected": (
        False,
        {"incident": None, "recovered": False},
        ["no fault was injected", "no incident was detected"],
    ),
    "another incident than the XID": (
        True,
        {"incident": "hang"},
        ["the XID 79 was not detected (the first incident: hang)"],
    ),
    "detected, never recovered": (
        True,
        {"recovered": False, "state": "failed", "final_step": 27},
        [
            "the fatal_xid incident was not recovered from (no productive step after it)",
            "the run did not complete: it is failed at step 27",
        ],
    ),
}


@pytest.mark.parametrize(("injected", "changes", "expected"), CASES.values(), ids=CASES.keys())
def test_shortfalls(injected: bool, changes: dict[str, Any], expected: list[str]) -> None:
    assert shortfalls({**RECOVERED, **changes}, injector(injected)) == expected
