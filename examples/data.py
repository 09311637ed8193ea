"""A synthetic but learnable token source with a resumable position.

Each sequence follows a fixed random Markov chain: from token ``v`` the next token is ``successor[v]`` with
probability ``1 - noise`` and uniform otherwise, so a model can learn it and its loss has a known floor. Sequence
``i`` depends only on ``(seed, i)``, so every parallel layout sees the same global batch at every step, and the
position (the next global step) is all that a checkpoint needs to resume the stream exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenSourceConfig:
    vocab_size: int
    seq_len: int
    batch_size: int
    seed: int = 0
    noise: float = 0.1

    def __post_init__(self) -> None:
        if self.vocab_size < 2:
            raise ValueError("data.vocab_size must be >= 2")
        if self.seq_len < 1 or self.batch_size < 1:
            raise ValueError("data.seq_len and data.batch_size must be >= 1")
        if not 0.0 <= self.noise <= 1.0:
            raise ValueError("data.noise must be in [0, 1]")


class TokenSource:
    """Deterministic stream of global batches; ``position`` is the index of the next step's batch."""

    def __init__(self, config: TokenSourceConfig) -> None:
        self.config = config
        chain = torch.Generator().manual_seed(config.seed)
        self.successor = torch.randperm(config.vocab_size, generator=chain)
        self.position = 0

    def sequence(self, index: int) -> torch.Tensor:
        """Sequence ``index`` of the stream: ``seq_len + 1`` tokens (inputs and shifted targets)."""
        cfg = self.config
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + index + 1)
        tokens = torch.empty(cfg.seq_len + 1, dtype=torch.long)
        tokens[0] = torch.randint(cfg.vocab_size, (1,), generator=gen)
        jumps = torch.rand(cfg.seq_len, generator=gen) < cfg.noise
        randoms = torch.randint(cfg.vocab_size, (cfg.seq_len,), generator=gen)
        for t in range(cfg.seq_len):
            tokens[t + 1] = randoms[t] if jumps[t] else self.successor[tokens[t]]
        return tokens

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets ``[batch_size, seq_len]`` of ``step``, the same on every rank."""
        first = step * self.config.batch_size
        rows = torch.stack([self.sequence(first + i) for i in range(self.config.batch_size)])
        return rows[:, :-1], rows[:, 1:]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch at ``position``, then advance."""
        batch = self.global_batch(self.position)
        self.position += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "seed": self.config.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state["seed"]) != self.config.seed:
            raise ValueError(f"data: checkpoint seed {state['seed']} differs from the run's seed {self.config.seed}")
        self.position = int(state["position"])
