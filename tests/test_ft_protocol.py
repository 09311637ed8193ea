"""The names and settings of fault-tolerant replica groups (opsd.protocol.ft): what a launcher sets, what a rank
accepts, and the one-line error of each bad value."""

from __future__ import annotations

from typing import Any

import pytest

from opsd.protocol.ft import (
    ADVERTISE_HOST_ENV,
    HEAL_FROM_PEER_ENV,
    LIGHTHOUSE_ENV,
    MIN_REPLICAS_ENV,
    QUORUM_RETRIES_ENV,
    QUORUM_TIMEOUT_ENV,
    REPLICA_GROUP_ENV,
    REPLICA_GROUPS_ENV,
    TIMEOUT_ENV,
    LighthouseConfig,
    ManagerTimeouts,
    ReplicaGroupEnv,
    group_layout,
)
from opsd.protocol.mesh import MeshSpec

GOOD = {LIGHTHOUSE_ENV: "http://lighthouse:29510", REPLICA_GROUP_ENV: "1", REPLICA_GROUPS_ENV: "2"}


def test_a_group_reads_back_what_its_launcher_set() -> None:
    sent = ReplicaGroupEnv(1, 3, "http://10.0.0.5:29510", 2, ManagerTimeouts(30, 20, 5, 4))
    env = sent.env()
    assert env[TIMEOUT_ENV] == "30"  # torchft's own variable, in whole seconds
    assert env[QUORUM_RETRIES_ENV] == "4"
    assert ReplicaGroupEnv.from_env(env) == sent
    relaunched = ReplicaGroupEnv(1, 3, "http://10.0.0.5:29510", heal_from_peer=True)
    assert relaunched.env()[HEAL_FROM_PEER_ENV] == "1"
    assert ReplicaGroupEnv.from_env(relaunched.env()) == relaunched
    in_a_pod = ReplicaGroupEnv(1, 3, "http://10.0.0.5:29510", advertise_host="10.1.2.3")
    assert ReplicaGroupEnv.from_env(in_a_pod.env()) == in_a_pod
    assert ADVERTISE_HOST_ENV not in relaunched.env()  # unset: the host's own name


@pytest.mark.parametrize(
    ("advertised", "url_host"),
    [
        ("", "node-7"),
        ("10.1.2.3", "10.1.2.3"),
        ("fd00::12", "[fd00::12]"),
        ("ranks-0.run.ns.svc", "ranks-0.run.ns.svc"),
    ],
)
def test_a_rank_is_reached_where_it_says(advertised: str, url_host: str) -> None:
    assert ReplicaGroupEnv(0, 2, "http://l:1", advertise_host=advertised).url_host("node-7") == url_host


def test_what_a_launcher_may_leave_out_has_defaults() -> None:
    replica = ReplicaGroupEnv.from_env(GOOD)
    assert (replica.group, replica.groups, replica.min_replicas, replica.heal_from_peer) == (1, 2, 1, False)
    assert replica.timeouts == ManagerTimeouts()


# name: (environment, the message's words)
BAD_ENV: dict[str, tuple[dict[str, str], str]] = {
    "no lighthouse": ({k: v for k, v in GOOD.items() if k != LIGHTHOUSE_ENV}, "TORCHFT_LIGHTHOUSE is not set"),
    "lighthouse not http": ({**GOOD, LIGHTHOUSE_ENV: "lighthouse:29510"}, "must be an http:// address"),
    "no group": ({k: v for k, v in GOOD.items() if k != REPLICA_GROUP_ENV}, "REPLICA_GROUP_ID is not set"),
    "group not a number": ({**GOOD, REPLICA_GROUP_ENV: "one"}, "REPLICA_GROUP_ID must be an integer, got 'one'"),
    "group out of range": (
        {**GOOD, REPLICA_GROUP_ENV: "2"},
        r"REPLICA_GROUP_ID=2 must be in \[0, NUM_REPLICA_GROUPS=2\)",
    ),
    "no groups": ({**GOOD, REPLICA_GROUPS_ENV: "0"}, "NUM_REPLICA_GROUPS must be >= 1"),
    "minimum above the groups": ({**GOOD, MIN_REPLICAS_ENV: "3"}, r"OPSD_FT_MIN_REPLICAS=3 must be in \[1, 2\]"),
    "fractional timeout": ({**GOOD, QUORUM_TIMEOUT_ENV: "1.5"}, "TORCHFT_QUORUM_TIMEOUT_SEC must be an integer"),
    "zero timeout": ({**GOOD, TIMEOUT_ENV: "0"}, "ft.timeout_s must be a whole number of seconds >= 1"),
    "negative retries": ({**GOOD, QUORUM_RETRIES_ENV: "-1"}, "ft.quorum_retries must be >= 0"),
    "heal flag not 0 or 1": ({**GOOD, HEAL_FROM_PEER_ENV: "yes"}, "OPSD_FT_HEAL_FROM_PEER must be 0 or 1, got 'yes'"),
    "advertised host with a scheme": (
        {**GOOD, ADVERTISE_HOST_ENV: "http://10.1.2.3"},
        "OPSD_FT_ADVERTISE_HOST must be a host name or an IP address, got 'http://10.1.2.3'",
    ),
}


@pytest.mark.parametrize("name", BAD_ENV)
def test_a_bad_variable_is_named(name: str) -> None:
    env, message = BAD_ENV[name]
    with pytest.raises(ValueError, match=message):
        ReplicaGroupEnv.from_env(env)


def test_the_lighthouse_command_line_carries_every_knob() -> None:
    argv = LighthouseConfig(min_replicas=2, quorum_tick_ms=50, join_timeout_ms=500, heartbeat_timeout_ms=900).argv(
        1234, command="lh"
    )
    assert argv == [
        "lh",
        *("--bind", "[::]:1234", "--min_replicas", "2", "--quorum_tick_ms", "50"),
        *("--join_timeout_ms", "500", "--heartbeat_timeout_ms", "900"),
    ]
    with pytest.raises(ValueError, match="not a TCP port"):
        LighthouseConfig().argv(70000)


BAD_LIGHTHOUSE: dict[str, tuple[dict[str, Any], str]] = {
    "no replica": ({"min_replicas": 0}, "lighthouse.min_replicas must be >= 1"),
    "no tick": ({"quorum_tick_ms": 0}, "lighthouse.quorum_tick_ms must be >= 1"),
    "heartbeat within a tick": (
        {"quorum_tick_ms": 100, "heartbeat_timeout_ms": 100},
        "heartbeat_timeout_ms must be > lighthouse.quorum_tick_ms",
    ),
}


@pytest.mark.parametrize("name", BAD_LIGHTHOUSE)
def test_a_bad_lighthouse_knob_is_named(name: str) -> None:
    fields, message = BAD_LIGHTHOUSE[name]
    with pytest.raises(ValueError, match=message):
        LighthouseConfig(**fields)


def test_a_group_is_the_job_without_its_replicas() -> None:
    replica = ReplicaGroupEnv.from_env(GOOD)
    assert group_layout(MeshSpec(dp_replicate=2, dp_shard=2, tp=2), replica) == MeshSpec(dp_shard=2, tp=2)
    with pytest.raises(ValueError, match="dp_replicate=3 must equal NUM_REPLICA_GROUPS=2"):
        group_layout(MeshSpec(dp_replicate=3), replica)
