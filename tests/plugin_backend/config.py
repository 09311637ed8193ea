"""The ledger backend's section of the settings (``controller.ledger``: ``OPSD_CONTROLLER_LEDGER_*``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LedgerConfig:
    path: str = "ledger.json"  # the machines' ledger
    gpus_per_node: int = 1  # ranks per node

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("controller.ledger.path must name a file")
        if self.gpus_per_node < 1:
            raise ValueError("controller.ledger.gpus_per_node must be >= 1")
