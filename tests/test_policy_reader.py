"""The ranks' side of the policy: decoding, the cadence, and a reader that never raises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opsd.protocol.policy_file import (
    EMPTY,
    Cadence,
    CheckpointCadence,
    Command,
    Policy,
    PolicyError,
    decode_policy,
    encode_policy,
)
from opsd_agent.reporter import write_policy
from trainer_hooks.policy_reader import PolicyReader


def cadence(every: int, start: int = 0, previous: tuple[int, int] | None = None, at: int | None = None) -> Policy:
    """A policy saving every ``every`` steps from ``start`` (``previous``: the (every, from) in force before)."""
    before = Cadence(every_steps=previous[0], from_step=previous[1]) if previous is not None else None
    return Policy(
        checkpoint=CheckpointCadence(every_steps=every, from_step=start, previous=before), checkpoint_at_step=at
    )


@pytest.mark.parametrize(
    ("every", "start", "due"),
    [(None, 0, []), (10, 0, [0, 10, 20]), (10, 15, [15, 25]), (1, 28, [28, 29])],
    ids=["no-cadence", "from-zero", "from-15", "every-step"],
)
def test_checkpoint_due(every: int | None, start: int, due: list[int]) -> None:
    policy = cadence(every, start) if every is not None else EMPTY
    assert [s for s in range(30) if policy.checkpoint_due(s)] == due


CHANGES = {
    # name: (policy, local cadence, steps due in 0..39)
    "before E: the local cadence": (cadence(10, 25), 4, [4, 8, 12, 16, 20, 24, 25, 35]),
    "before E: the previous published one": (cadence(10, 25, (6, 6)), 4, [4, 6, 12, 18, 24, 25, 35]),
    "before the previous one: local": (cadence(10, 25, (6, 18)), 4, [4, 8, 12, 16, 18, 24, 25, 35]),
    "a one-off step besides the cadence": (cadence(10, 25, at=31), 4, [4, 8, 12, 16, 20, 24, 25, 31, 35]),
    "a one-off step without a cadence": (Policy(checkpoint_at_step=7), 100, [7]),
}


@pytest.mark.parametrize(("policy", "local", "due"), CHANGES.values(), ids=CHANGES.keys())
def test_a_new_cadence_takes_effect_only_from_its_step(policy: Policy, local: int, due: list[int]) -> None:
    assert [s for s in range(40) if policy.checkpoint_due(s, local=s > 0 and s % local == 0)] == due


def test_a_one_off_checkpoint_step_is_decoded() -> None:
    assert decode_policy(json.dumps({"v": 1, "checkpoint_at_step": 120}).encode()).checkpoint_at_step == 120
    assert decode_policy(b'{"v": 1}').checkpoint_at_step is None


def test_previous_cadence_is_decoded() -> None:
    doc = {"v": 1, "checkpoint": {"every_steps": 10, "from_step": 25, "previous": {"every_steps": 6, "from_step": 6}}}
    policy = decode_policy(json.dumps(doc).encode())
    assert policy.checkpoint is not None
    assert policy.checkpoint.previous == Cadence(every_steps=6, from_step=6)
    with pytest.raises(PolicyError, match=r"\$\.checkpoint\.previous"):
        decode_policy(json.dumps({"v": 1, "checkpoint": {"every_steps": 1, "previous": 3}}).encode())


def test_the_policy_always_says_its_version_and_leaves_out_what_it_does_not_say() -> None:
    assert json.loads(encode_policy(EMPTY)) == {"v": 1}
    policy = Policy(checkpoint_at_step=9, commands=(Command(id="c-1", name="dump_flight_recorder"),))
    assert json.loads(encode_policy(policy)) == {
        "v": 1,
        "checkpoint_at_step": 9,
        "commands": [{"id": "c-1", "name": "dump_flight_recorder"}],
    }
    assert decode_policy(encode_policy(policy)) == policy
    # a run that had a command and has none now says so: its agents rewrite a file that held one
    assert json.loads(encode_policy(Policy(commands=())))["commands"] == []


def test_a_policy_without_its_version_is_read_as_version_1() -> None:
    """What a controller before the version tag sends in its replies."""
    assert decode_policy(b'{"checkpoint_at_step": 4}') == Policy(checkpoint_at_step=4)


BAD = {
    "not json": (b"{", "malformed|truncated"),
    "not an object": (b"[1]", "Expected `object`"),
    "another version": (b'{"v": 2}', r"at `\$\.v`"),
    "zero cadence": (json.dumps({"v": 1, "checkpoint": {"every_steps": 0}}).encode(), r"\$\.checkpoint\.every_steps"),
    "bool cadence": (json.dumps({"v": 1, "checkpoint": {"every_steps": True}}).encode(), r"\.every_steps"),
    "no every_steps": (json.dumps({"v": 1, "checkpoint": {"from_step": 3}}).encode(), "every_steps"),
    "negative start": (
        json.dumps({"v": 1, "checkpoint": {"every_steps": 5, "from_step": -1}}).encode(),
        r"\$\.checkpoint\.from_step",
    ),
    "one-off step zero": (json.dumps({"v": 1, "checkpoint_at_step": 0}).encode(), r"\$\.checkpoint_at_step"),
    "one-off step text": (json.dumps({"v": 1, "checkpoint_at_step": "9"}).encode(), r"\$\.checkpoint_at_step"),
    "commands not a list": (json.dumps({"v": 1, "commands": {}}).encode(), r"\$\.commands"),
    "command without id": (json.dumps({"v": 1, "commands": [{"name": "x"}]}).encode(), "`id`"),
    "ranks not ints": (
        json.dumps({"v": 1, "commands": [{"id": "1", "name": "x", "ranks": ["a"]}]}).encode(),
        r"\$\.commands\[0\]\.ranks\[0\]",
    ),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_policy_is_rejected(name: str) -> None:
    data, message = BAD[name]
    with pytest.raises(PolicyError, match=message):
        decode_policy(data)


def test_reader_keeps_the_last_good_policy_and_checks_at_most_every_interval(tmp_path: Path) -> None:
    path = tmp_path / "policy.json"
    now = [0.0]
    reader = PolicyReader(str(path), check_every_s=1.0, clock=lambda: now[0])
    write_policy(path, cadence(10))
    assert reader.current() == cadence(10)
    write_policy(path, cadence(20))
    now[0] = 0.5
    assert reader.current() == cadence(10)  # not looked at yet
    now[0] = 1.5
    assert reader.current() == cadence(20)
    path.write_text("{broken")
    now[0] = 3.0
    assert reader.current() == cadence(20)  # the last good one
    now[0] = 4.5
    reader.current()
    assert reader.errors == 1  # a bad file is reported once
    path.unlink()
    now[0] = 6.0
    assert reader.current() == cadence(20)


def test_reader_without_a_path_is_empty() -> None:
    assert PolicyReader(None).current() == EMPTY
