"""What every backend shares beside the port (``opsd.controller.steps``): a step once per request id, and opsd's
errors as the port's data."""

from __future__ import annotations

import pytest

from opsd.controller.port import Done, ErrorKind, Failed, Outcome, Pending
from opsd.controller.steps import Once, as_outcome
from opsd.errors import ConfigError, NotFoundError, OpsError, TransientError


def test_a_request_id_is_carried_out_once_and_a_repeat_answers_the_first_outcome() -> None:
    once, calls = Once(), []

    def step() -> Outcome[dict[str, int]]:
        calls.append(1)
        return Done({"n": len(calls)})

    assert once("r-1", step) == Done({"n": 1})
    assert once("r-1", step) == Done({"n": 1})
    assert once("r-2", step) == Done({"n": 2})
    assert len(calls) == 2


@pytest.mark.parametrize("outcome", [Pending("placing pods"), Failed(ErrorKind.TRANSIENT, "429")], ids=str)
def test_a_step_not_done_is_carried_out_again(outcome: Outcome[dict[str, int]]) -> None:
    once, answers = Once(), [outcome, Done[dict[str, int]]({})]
    assert once("r-1", lambda: answers.pop(0)) == outcome
    assert once("r-1", lambda: answers.pop(0)) == Done({})
    assert answers == []


def raising(exc: BaseException) -> Outcome[None]:
    raise exc


ERRORS = {
    "not found": (NotFoundError("no node 'n9'"), Failed(ErrorKind.NOT_FOUND, "no node 'n9'")),
    "transient": (TransientError("429 from a budget", 7.0), Failed(ErrorKind.TRANSIENT, "429 from a budget", 7.0)),
    "a refused setting": (ConfigError("bad"), Failed(ErrorKind.PERMANENT, "stop job: bad")),
    "any other of opsd's": (OpsError("forbidden"), Failed(ErrorKind.PERMANENT, "stop job: forbidden")),
}


@pytest.mark.parametrize(("error", "outcome"), ERRORS.values(), ids=ERRORS.keys())
def test_opsd_errors_become_the_ports_data(error: OpsError, outcome: Failed) -> None:
    assert as_outcome("stop job", lambda: raising(error)) == outcome


def test_a_bug_still_raises() -> None:
    with pytest.raises(KeyError):
        as_outcome("stop job", lambda: raising(KeyError("x")))
