"""``opsd serve``'s settings (``ServeConfig``), apart from the server itself: the command line reads them, and the
agent's command imports no server to do it."""

from __future__ import annotations

from dataclasses import dataclass, field

from opsd.controller.config import ControllerConfig


@dataclass(frozen=True)
class ServeConfig:
    """``opsd serve``'s settings: where the API listens, where the state is, and the controller's configuration (its
    fields are set at the same level of the settings file: ``controller.hang_floor_s`` is
    ``controller.detection.hang_floor_s``'s neighbour; docs/configuration.md)."""

    host: str = "127.0.0.1"
    port: int = 8470
    state_dir: str = ".opsd"
    state_url: str = ""  # default: sqlite:///<state_dir>/opsd.db
    token: str = ""  # the operators' (every endpoint); default: <state_dir>/token, created once
    reader_token: str = ""  # the readers' (every read, /metrics); none: only the operators' token reads
    agent_token: str = ""  # the agents' (heartbeats, Flight Recorder uploads)
    metrics_token: str = ""  # Prometheus's (/metrics)
    # each role's token before the last rotation, taken beside the current one (docs/kubernetes.md, "Credentials")
    previous_token: str = ""
    previous_reader_token: str = ""
    previous_agent_token: str = ""
    previous_metrics_token: str = ""
    tls_certfile: str = ""  # HTTPS with this certificate (PEM) and the key below; none: plain HTTP
    tls_keyfile: str = ""
    tls_reload_every_s: float = 10.0  # the certificate's files read again this often; changed: loaded again
    tick_interval_s: float = 0.5  # between two detection passes
    liveness_port: int | None = 8470  # UDP, the agents' liveness datagrams (0: any free port; None: none)
    heartbeat_port: int | None = 8471  # TCP, the heartbeats' own process (0: any free port; None: the API alone)
    keep_alive_s: float = 30.0  # an idle keep-alive connection (an agent's, between heartbeats) is closed after this
    controller: ControllerConfig = field(default_factory=ControllerConfig, metadata={"inline": True})

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("controller.port must be in 0..65535")
        if self.liveness_port is not None and not 0 <= self.liveness_port <= 65535:
            raise ValueError("controller.liveness_port must be in 0..65535")
        if self.heartbeat_port is not None and not 0 <= self.heartbeat_port <= 65535:
            raise ValueError("controller.heartbeat_port must be in 0..65535")
        if self.heartbeat_port and self.heartbeat_port == self.port:
            raise ValueError("controller.heartbeat_port must differ from controller.port")
        if self.keep_alive_s <= self.controller.telemetry.max_interval_s:
            raise ValueError("controller.keep_alive_s must be > controller.telemetry.max_interval_s")
        if self.tick_interval_s <= 0:
            raise ValueError("controller.tick_interval_s must be > 0")
        if self.tls_reload_every_s <= 0:
            raise ValueError("controller.tls_reload_every_s must be > 0")
        if bool(self.tls_certfile) != bool(self.tls_keyfile):
            raise ValueError("controller.tls_certfile and controller.tls_keyfile go together: set both or neither")
