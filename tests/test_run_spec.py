"""A run's spec as the state store keeps it (opsd.controller.rows): what every backend's runs have, and the
backend's own part, a struct of the backend's read back with ``own_as``; a store written before the own parts (the
backends' fields at the top) reads as the same run."""

from __future__ import annotations

import pytest

from opsd.backends.kubernetes.refs import RunRef
from opsd.backends.local.spec import LocalNodes, LocalRunSpec
from opsd.controller.rows import RunSpec, decode_spec, encode_spec
from opsd.errors import BodyError
from opsd.policy.recovery import OnNoSpare

#: specs as a controller before the own parts wrote them (their JSON, as the store has it)
EARLIER_LOCAL = (
    '{"backend":"local","nodes":3,"spares":1,"gpus_per_node":2,"checkpoint_url":"file:///c","on_no_spare":"shrink",'
    '"min_nodes":2,"namespace":"","jobset":"","attached":false,"observed":false,"replica_groups":1,"min_replicas":1}'
)
EARLIER_ATTACHED = (
    '{"backend":"kubernetes","nodes":null,"spares":null,"gpus_per_node":null,"checkpoint_url":"",'
    '"on_no_spare":"wait","min_nodes":1,"namespace":"ml","jobset":"trainjob-7","attached":true,"observed":false,'
    '"replica_groups":2,"min_replicas":1}'
)


def test_a_backends_part_goes_through_the_store_as_its_struct() -> None:
    local = LocalRunSpec("r", ("true",), nodes=3, spares=1, gpus_per_node=2).recorded()
    attached = RunSpec(backend="kubernetes").with_own(RunRef("ml", "trainjob-7", attached=True))

    assert decode_spec(encode_spec(local)).own_as(LocalNodes) == LocalNodes(3, 1, 2)
    assert decode_spec(encode_spec(attached)).own_as(RunRef) == RunRef("ml", "trainjob-7", attached=True)
    assert decode_spec(encode_spec(attached)) == attached


def test_a_spec_of_an_earlier_store_keeps_its_backends_fields() -> None:
    local = decode_spec(EARLIER_LOCAL)
    attached = decode_spec(EARLIER_ATTACHED)

    assert (local.backend, local.checkpoint_url, local.on_no_spare, local.min_nodes) == (
        "local",
        "file:///c",
        OnNoSpare.SHRINK,
        2,
    )
    assert local.own_as(LocalNodes) == LocalNodes(3, 1, 2)
    assert attached.own_as(RunRef) == RunRef("ml", "trainjob-7", attached=True)
    assert attached.replica_groups == 2
    assert decode_spec(encode_spec(attached)) == attached  # written again in the new shape, read the same


def test_a_part_that_does_not_fit_the_struct_asked_for_is_a_body_error() -> None:
    observed = RunSpec(observed=True)  # a run first heard of in a heartbeat: no backend, no part

    with pytest.raises(BodyError, match="does not fit RunRef"):
        observed.own_as(RunRef)
    with pytest.raises(BodyError, match="does not fit LocalNodes"):
        decode_spec(EARLIER_ATTACHED).own_as(LocalNodes)


def test_a_spec_that_does_not_fit_reads_as_empty() -> None:
    assert decode_spec('{"backend": 3}') == RunSpec()
    assert decode_spec("not json") == RunSpec()
