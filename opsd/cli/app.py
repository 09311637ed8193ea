"""The ``opsd`` command line: the processes (``agent``, ``serve``, ``run``: ``opsd.cli.serve``), the operator's
commands (``opsd.cli.ops``), the analyses (``simulate``, ``plan``: ``opsd.cli.analysis``) and the dashboards
(``opsd.cli.dashboards``)."""

from __future__ import annotations

import typer

from opsd import __version__
from opsd.cli import analysis, ops, serve
from opsd.cli.dashboards import dashboards_app

app = typer.Typer(
    name="opsd",
    help="Operations and observability for long distributed PyTorch training runs.",
    epilog=(
        "Exit codes: 0 done; 1 the controller refused, failed or could not be reached (reason on stderr);"
        " 2 a bad command line or config file; 3 restart --wait gave up waiting. `opsd run` exits 1 unless the run"
        " completed, `opsd plan` 1 when the layout does not fit."
    ),
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


serve.register(app)
ops.register(app)
analysis.register(app)
app.add_typer(dashboards_app, name="dashboards")
