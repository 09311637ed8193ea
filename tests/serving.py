"""The controller's API served for a test: on loopback, in a thread of its own (``opsd.runtime.server.Serving``), no
detection pass (the test drives the controller)."""

from __future__ import annotations

import uvicorn

from opsd.api.auth import Credentials
from opsd.controller.controller import Controller
from opsd.runtime.server import ServeConfig, Serving


def start_api(controller: Controller, token: str | Credentials, host: str, port: int) -> uvicorn.Server:
    """The API of ``controller`` on ``host:port`` (``token``: the operators', or every role's); returns once it
    listens. Set ``should_exit`` on the answer to stop it."""
    serving = Serving(ServeConfig(host=host, port=port, liveness_port=0), controller, token)
    serving.start()
    return serving.server
