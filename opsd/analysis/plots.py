"""PNG plots (matplotlib, without a display)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def plot_ettr_sweep(
    intervals_s: Sequence[float],
    ettrs: Sequence[float],
    chosen: tuple[float, float],
    daly_s: float,
    title: str,
    path: str | Path,
) -> None:
    """ETTR against the checkpoint interval, with the chosen policy's point marked and Young/Daly's interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4.5), dpi=100)
    try:
        axes.plot([i / 60 for i in intervals_s], ettrs, marker=".", label="fixed interval")
        axes.axvline(daly_s / 60, color="grey", linestyle="--", label=f"Young/Daly at the true MTBF ({daly_s:.0f} s)")
        axes.plot(
            [chosen[0] / 60], [chosen[1]], marker="*", markersize=14, color="red", linestyle="", label="opsd adaptive"
        )
        axes.set_xscale("log")
        axes.set_xlabel("checkpoint interval (minutes)")
        axes.set_ylabel("ETTR")
        axes.set_title(title)
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(loc="lower center")
        figure.tight_layout()
        figure.savefig(path, format="png")
    finally:
        plt.close(figure)
