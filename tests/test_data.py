"""The synthetic token source: deterministic per (seed, index), learnable, resumable."""

from __future__ import annotations

import pytest
import torch

from examples.data import TokenSource, TokenSourceConfig

CFG = TokenSourceConfig(vocab_size=64, seq_len=32, batch_size=4, seed=3)


def test_same_seed_same_stream_other_seed_other_stream() -> None:
    a, b, c = TokenSource(CFG), TokenSource(CFG), TokenSource(TokenSourceConfig(64, 32, 4, seed=4))
    assert torch.equal(a.global_batch(5)[0], b.global_batch(5)[0])
    assert not torch.equal(a.global_batch(5)[0], c.global_batch(5)[0])
    assert not torch.equal(a.global_batch(5)[0], a.global_batch(6)[0])


def test_targets_are_inputs_shifted() -> None:
    inputs, targets = TokenSource(CFG).global_batch(0)
    assert inputs.shape == targets.shape == (4, 32)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_stream_follows_its_chain_mostly() -> None:
    source = TokenSource(CFG)
    inputs, targets = source.global_batch(0)
    follows = (source.successor[inputs] == targets).float().mean().item()
    assert follows > 0.8  # noise 0.1: about 90% of the transitions are the chain's


def test_resume_continues_the_stream() -> None:
    first = TokenSource(CFG)
    for _ in range(3):
        first.next_batch()
    state = first.state_dict()
    resumed = TokenSource(CFG)
    resumed.load_state_dict(state)
    assert resumed.position == 3
    assert torch.equal(resumed.next_batch()[0], first.next_batch()[0])


def test_resume_refuses_another_seed() -> None:
    other = TokenSource(TokenSourceConfig(64, 32, 4, seed=9))
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(TokenSource(CFG).state_dict())


@pytest.mark.parametrize(
    "kwargs",
    [
        {"vocab_size": 1, "seq_len": 4, "batch_size": 1},
        {"vocab_size": 8, "seq_len": 0, "batch_size": 1},
        {"vocab_size": 8, "seq_len": 4, "batch_size": 1, "noise": 1.5},
    ],
    ids=["vocab", "seq_len", "noise"],
)
def test_bad_config(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="data\\."):
        TokenSourceConfig(**kwargs)  # type: ignore[arg-type]
