"""``python -m opsd``: the same as the ``opsd`` command."""

from opsd.cli.app import app

app(prog_name="opsd")
