"""The soak's selection and report (``tools/soak.py``): which modules start processes, each run's JUnit report
read per test, and the table, whose last line counts every failed test run."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.launch import NO_RELAUNCH_ENV, ROOT
from tools import soak

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_a" name="test_ok" time="0.1"/>
<testcase classname="tests.test_a" name="test_bad" time="0.1"><failure message="AssertionError: 1 != 2">
Traceback
line 1
line 2
E  assert 1 == 2</failure></testcase>
<testcase classname="tests.test_b.TestThing" name="test_setup" time="0.1"><error message="fixture failed">boom
</error></testcase>
<testcase classname="tests.test_b" name="test_skipped" time="0"><skipped message="no helm"/></testcase>
</testsuite></testsuites>
"""


def test_the_report_reads_each_test_and_skips_are_no_runs(tmp_path: Path) -> None:
    path = tmp_path / "junit.xml"
    path.write_text(REPORT)
    results = soak.junit_outcomes(path)
    assert set(results) == {"tests.test_a::test_ok", "tests.test_a::test_bad", "tests.test_b.TestThing::test_setup"}
    assert results["tests.test_a::test_ok"] == (False, "")
    failed, why = results["tests.test_a::test_bad"]
    assert failed
    assert why.splitlines()[-1] == "E  assert 1 == 2"
    assert results["tests.test_b.TestThing::test_setup"][0]


def test_the_table_names_failing_tests_and_counts_every_failed_run(tmp_path: Path) -> None:
    outcomes: dict[str, soak.Outcome] = {}
    soak.add_run(outcomes, 1, {"t::a": (False, ""), "t::b": (True, "first why")})
    soak.add_run(outcomes, 2, {"t::a": (True, "a's why"), "t::b": (True, "second why")})
    soak.add_run(outcomes, 3, {"t::a": (False, ""), "t::b": (False, ""), "t::c": (False, "")})
    lines = soak.table(outcomes, burned=[2])
    assert lines[-1] == "soak_failures=3"
    assert lines[-2] == "1 of 3 tests never failed"
    rows = [line.split() for line in lines if line.startswith("t::")]
    assert rows == [["t::b", "3", "2", "1,", "2*"], ["t::a", "3", "1", "2*"]]
    assert "    | first why" in lines  # the first failure's lines, not a later one's
    assert "    | second why" not in lines
    # each run names its failures as it ends: a soak stopped early still says which
    assert soak.failed_in(2, {"t::b": (True, "why"), "t::a": (True, "why"), "t::c": (False, "")}) == [
        "  failed in run 2: t::a",
        "  failed in run 2: t::b",
    ]


def test_the_soak_selects_the_modules_that_start_processes_and_retries_nothing() -> None:
    modules = soak.process_modules(ROOT / "tests")
    assert "tests/test_flight.py" in modules  # torchrun through run_module
    assert "tests/test_agent_down.py" in modules  # opsd run through subprocess
    assert "tests/test_policy_detection.py" not in modules  # pure
    assert soak.NO_RELAUNCH_ENV == NO_RELAUNCH_ENV  # the variable tests.launch reads


def test_a_failed_runs_files_are_kept_for_the_diagnosis(tmp_path: Path) -> None:
    """With ``--keep``: each run's output, and the files of a run that failed (its tests' temporary directories)."""
    module = tmp_path / "test_soaked.py"
    module.write_text(
        "import socket\n"
        "def test_writes_then_fails(tmp_path):\n"
        "    (tmp_path / 'rank0.log').write_text('what the rank said')\n"
        "    socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).bind(str(tmp_path / 'agent.sock'))  # an agent's\n"
        "    assert False\n"
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -p no:kmock\n")  # as the project's settings have it
    keep = tmp_path / "keep"
    keep.mkdir()
    outcomes = soak.soak_run(sys.executable, [str(module)], 1, False, keep)
    assert [failed for failed, _ in outcomes.values()] == [True]
    assert (keep / "run-1.log").exists()
    (kept,) = (keep / "run-1-files").rglob("rank0.log")
    assert kept.read_text() == "what the rank said"
    assert not list((keep / "run-1-files").rglob("agent.sock"))  # a socket is no file to keep
