"""The ranks' side of the policy file: parsing, the cadence, and a reader that never raises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.reporter import write_policy
from opsd.protocol.policy_file import Policy, PolicyError, parse_policy
from trainer_hooks.policy_reader import PolicyReader


@pytest.mark.parametrize(
    ("every", "start", "due"),
    [(None, 0, []), (10, 0, [0, 10, 20]), (10, 15, [15, 25]), (1, 28, [28, 29])],
    ids=["no-cadence", "from-zero", "from-15", "every-step"],
)
def test_checkpoint_due(every: int | None, start: int, due: list[int]) -> None:
    assert [s for s in range(30) if Policy(every, start).checkpoint_due(s)] == due


CHANGES = {
    # name: (policy, local cadence, steps due in 0..39)
    "before E: the local cadence": (Policy(10, 25), 4, [4, 8, 12, 16, 20, 24, 25, 35]),
    "before E: the previous published one": (Policy(10, 25, (), 6, 6), 4, [4, 6, 12, 18, 24, 25, 35]),
    "before the previous one: local": (Policy(10, 25, (), 6, 18), 4, [4, 8, 12, 16, 18, 24, 25, 35]),
    "a one-off step besides the cadence": (
        Policy(10, 25, checkpoint_at_step=31),
        4,
        [4, 8, 12, 16, 20, 24, 25, 31, 35],
    ),
    "a one-off step without a cadence": (Policy(checkpoint_at_step=7), 100, [7]),
}


@pytest.mark.parametrize(("policy", "local", "due"), CHANGES.values(), ids=CHANGES.keys())
def test_a_new_cadence_takes_effect_only_from_its_step(policy: Policy, local: int, due: list[int]) -> None:
    assert [s for s in range(40) if policy.checkpoint_due(s, local=s > 0 and s % local == 0)] == due


def test_a_one_off_checkpoint_step_is_parsed() -> None:
    assert parse_policy(json.dumps({"v": 1, "checkpoint_at_step": 120}).encode()).checkpoint_at_step == 120
    assert parse_policy(b'{"v": 1}').checkpoint_at_step is None


def test_previous_cadence_is_parsed() -> None:
    doc = {"v": 1, "checkpoint": {"every_steps": 10, "from_step": 25, "previous": {"every_steps": 6, "from_step": 6}}}
    policy = parse_policy(json.dumps(doc).encode())
    assert (policy.previous_every_steps, policy.previous_from_step) == (6, 6)
    with pytest.raises(PolicyError, match="previous must be an object"):
        parse_policy(json.dumps({"v": 1, "checkpoint": {"every_steps": 1, "previous": 3}}).encode())


BAD = {
    "not json": (b"{", "not JSON"),
    "no version": (b"{}", "v = 1"),
    "zero cadence": (json.dumps({"v": 1, "checkpoint": {"every_steps": 0}}).encode(), "every_steps must be"),
    "bool cadence": (json.dumps({"v": 1, "checkpoint": {"every_steps": True}}).encode(), "every_steps must be"),
    "negative start": (
        json.dumps({"v": 1, "checkpoint": {"every_steps": 5, "from_step": -1}}).encode(),
        "from_step must be",
    ),
    "one-off step zero": (json.dumps({"v": 1, "checkpoint_at_step": 0}).encode(), "checkpoint_at_step must be"),
    "one-off step text": (json.dumps({"v": 1, "checkpoint_at_step": "9"}).encode(), "checkpoint_at_step must be"),
    "commands not a list": (json.dumps({"v": 1, "commands": {}}).encode(), "must be a list"),
    "command without id": (json.dumps({"v": 1, "commands": [{"name": "x"}]}).encode(), "string id and name"),
    "ranks not ints": (
        json.dumps({"v": 1, "commands": [{"id": "1", "name": "x", "ranks": ["a"]}]}).encode(),
        "list of ranks",
    ),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_policy_is_rejected(name: str) -> None:
    data, message = BAD[name]
    with pytest.raises(PolicyError, match=message):
        parse_policy(data)


def test_reader_keeps_the_last_good_policy_and_checks_at_most_every_interval(tmp_path: Path) -> None:
    path = tmp_path / "policy.json"
    now = [0.0]
    reader = PolicyReader(str(path), check_every_s=1.0, clock=lambda: now[0])
    write_policy(path, {"checkpoint": {"every_steps": 10}})
    assert reader.current().checkpoint_every_steps == 10
    write_policy(path, {"checkpoint": {"every_steps": 20}})
    now[0] = 0.5
    assert reader.current().checkpoint_every_steps == 10  # not looked at yet
    now[0] = 1.5
    assert reader.current().checkpoint_every_steps == 20
    path.write_text("{broken")
    now[0] = 3.0
    assert reader.current().checkpoint_every_steps == 20  # the last good one
    now[0] = 4.5
    reader.current()
    assert reader.errors == 1  # a bad file is reported once
    path.unlink()
    now[0] = 6.0
    assert reader.current().checkpoint_every_steps == 20


def test_reader_without_a_path_is_empty() -> None:
    assert PolicyReader(None).current() == Policy()
