"""The controller's API served for a test: on loopback, in a thread of its own (``opsd.runtime.server.Serving``), no
detection pass (the test drives the controller)."""

from __future__ import annotations

import uvicorn

from opsd.api.auth import Credentials
from opsd.controller.controller import Controller
from opsd.runtime.config import ServeConfig
from opsd.runtime.server import Serving


def start_api(
    controller: Controller, token: str | Credentials, host: str, port: int, *, heartbeat_port: int | None = None
) -> uvicorn.Server:
    """The API of ``controller`` on ``host:port`` (``token``: the operators', or every role's), its liveness
    datagrams on any free port, and its heartbeat process on ``heartbeat_port`` (None: none); returns once it
    listens. Set ``should_exit`` on the answer to stop it."""
    config = ServeConfig(host=host, port=port, liveness_port=0, heartbeat_port=heartbeat_port)
    serving = Serving(config, controller, token)
    serving.start()
    return serving.server
