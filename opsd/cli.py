"""The ``opsd`` command line."""

from __future__ import annotations

import typer

from opsd import __version__

app = typer.Typer(
    name="opsd",
    help="Operations and observability for long distributed PyTorch training runs.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def main() -> None:
    """opsd: watch, heal and explain long distributed training runs."""


@app.command()
def version() -> None:
    """Print the opsd version."""
    typer.echo(__version__)
