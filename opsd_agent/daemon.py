"""The agent process: receives the ranks' datagrams, keeps the node's state, serves ``/metrics`` and ``/healthz``.

    agent = Agent(AgentConfig(socket="/run/opsd/agent.sock", metrics_port=9464))
    agent.start()      # threads: datagram receivers, HTTP server, expiry
    ...
    agent.stop()

Ranks send their datagrams to the Unix socket ``socket`` (a host directory the training pods mount) or, with
``datagram_port`` set, to its UDP port (pods with no host directory: ``opsd.protocol.node_agent``); both are taken
the same way. A malformed datagram is counted by the rule it breaks and dropped; nothing a sender does stops the
receiver. The HTTP endpoints are ``opsd_agent.endpoints``'.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from socket import gethostname
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from opsd.policy.xid import WatchWindow
from opsd.protocol.rank_auth import MAX_DATAGRAM_BYTES, RankAuth, split_signed
from opsd.protocol.wire import MAX_MESSAGE_BYTES, ActivityReport, TimeoutReport, WireError, decode_report
from opsd.protocol.xid_table import load_xid_table
from opsd_agent.endpoints import DumpIntake, DumpIntakeCollector, handler
from opsd_agent.flight import FlightUploader, FlightUploaderConfig, controller_base
from opsd_agent.gpu_access import GpuAccess, GpuAccessCollector
from opsd_agent.health import GpuHealth, GpuHealthCollector
from opsd_agent.metrics import AgentCollector, AgentStats, FlightCollector, ReporterCollector
from opsd_agent.rank_gate import RankGate, RankGateCollector
from opsd_agent.reporter import Reporter, ReporterConfig
from opsd_agent.state import NodeState
from opsd_agent.tracing import Tracing

log = logging.getLogger(__name__)

UNIX_PATH_MAX = 107  # sun_path is 108 bytes with its terminating NUL


def shared_directory(path: str) -> None:
    """Make ``path`` (the ranks' Flight Recorder dumps) if missing, writable by every user with the sticky bit,
    as /tmp: the ranks run as any user, the agent as root."""
    if not os.path.isdir(path):
        os.makedirs(path, exist_ok=True)
        os.chmod(path, 0o1777)


@dataclass(frozen=True)
class AgentConfig:
    socket: str = "/tmp/opsd-agent.sock"
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9464  # 0: any free port
    metrics_token: str = ""  # /metrics needs it as a bearer token when set
    previous_metrics_token: str = ""  # taken beside it until the next rotation (docs/kubernetes.md, "Credentials")
    datagram_host: str = "127.0.0.1"
    datagram_port: int | None = None  # UDP port for the ranks' datagrams (None: none; 0: any free port)
    node: str = field(default_factory=gethostname)
    receive_buffer_bytes: int = 4 << 20
    stale_after_s: float = 600.0
    # a rank not heard from for this long (and 10 of its steps) leaves /metrics until it reports again
    quiet_after_s: float = 30.0
    max_comm_series: int = 8
    gpu_source: str = "none"  # nvml | none | file:DIRECTORY (the fake)
    gpu_interval_s: float = 5.0
    gpu_retry_s: float = 60.0  # a GPU source that cannot be opened is tried again this often
    xid_table: str | None = None  # default: the table shipped with opsd
    xid_window_s: float = 3600.0
    xid_threshold: int = 3
    controller_url: str | None = None  # heartbeats go there when set
    controller_token: str = ""
    heartbeat_interval_s: float = 1.0
    liveness_datagrams: bool = (
        True  # liveness by UDP datagram every heartbeat_interval_s, where the controller takes them
    )
    policy_file: str | None = None  # where the controller's policy is written for the ranks
    flight_dir: str | None = None  # where the ranks write Flight Recorder dumps (sent with controller_url)
    rank_secret: str = ""  # the runs' keys derive from it (opsd.protocol.rank_auth)
    rank_auth: RankAuth = RankAuth.OFF  # what the network endpoints ask of a rank (optional without a secret: off)

    def __post_init__(self) -> None:
        if not self.socket:
            raise ValueError("agent.socket must not be empty")
        if len(os.fsencode(self.socket)) > UNIX_PATH_MAX:
            raise ValueError(f"agent.socket must be at most {UNIX_PATH_MAX} bytes (a Unix socket path)")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError("agent.metrics_port must be in 0-65535")
        if self.datagram_port is not None and not 0 <= self.datagram_port <= 65535:
            raise ValueError("agent.datagram_port must be in 0-65535")
        if not self.node:
            raise ValueError("agent.node must not be empty")
        if self.receive_buffer_bytes < MAX_MESSAGE_BYTES:
            raise ValueError(f"agent.receive_buffer_bytes must be >= {MAX_MESSAGE_BYTES}")
        if self.stale_after_s <= 0:
            raise ValueError("agent.stale_after_s must be > 0")
        if self.quiet_after_s <= 0:
            raise ValueError("agent.quiet_after_s must be > 0")
        if self.max_comm_series < 1:
            raise ValueError("agent.max_comm_series must be >= 1")
        if not (self.gpu_source in ("nvml", "none") or self.gpu_source.startswith("file:")):
            raise ValueError("agent.gpu_source must be nvml, none or file:DIRECTORY")
        if self.gpu_interval_s <= 0 or self.gpu_retry_s <= 0:
            raise ValueError("agent.gpu_interval_s and agent.gpu_retry_s must be > 0")
        WatchWindow(self.xid_window_s, self.xid_threshold)  # validates them
        if self.rank_auth is RankAuth.REQUIRED and not self.rank_secret:
            raise ValueError("agent.rank_auth required needs agent.rank_secret")
        if self.controller_url is not None:
            self.reporter_config()  # validates the reporter's settings
            if self.flight_dir:
                self.flight_config()

    def reporter_config(self) -> ReporterConfig:
        if self.controller_url is None:
            raise ValueError("agent.controller_url is not set")
        return ReporterConfig(
            url=self.controller_url,
            token=self.controller_token,
            interval_s=self.heartbeat_interval_s,
            max_backoff_s=max(30.0, self.heartbeat_interval_s),
            policy_path=self.policy_file,
            datagrams=self.liveness_datagrams,
        )

    def flight_config(self) -> FlightUploaderConfig:
        if self.controller_url is None or not self.flight_dir:
            raise ValueError("agent.controller_url and agent.flight_dir must be set")
        return FlightUploaderConfig(self.flight_dir, controller_base(self.controller_url), self.controller_token)


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.state = NodeState(max_comm_series=config.max_comm_series, stale_after_s=config.stale_after_s)
        self.stats = AgentStats()
        self.registry = CollectorRegistry()
        self.registry.register(AgentCollector(self.state, self.stats, config.node, config.quiet_after_s))
        self.gpu: GpuHealth | None = None
        self.gpu_access: GpuAccess | None = None
        self.reporter: Reporter | None = None
        self.flight: FlightUploader | None = None
        self.registry.register(FlightCollector(lambda: self.flight, config.node))
        self.tracing: Tracing | None = None
        self.intake = DumpIntake(config.flight_dir)
        self.registry.register(DumpIntakeCollector(self.intake, config.node))
        self.ranks = RankGate(config.rank_secret, config.rank_auth if config.rank_secret else RankAuth.OFF)
        self.registry.register(RankGateCollector(self.ranks, config.node))
        self._sock: socket.socket | None = None
        self._udp: socket.socket | None = None
        self._http: ThreadingHTTPServer | None = None
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()

    # -- ingest ----------------------------------------------------------------------------------------------
    def handle(self, data: bytes, now_s: float | None = None, *, network: bool = False) -> str | None:
        """Take one datagram (``network``: from the UDP port, where the run's key is asked for; a signature is
        taken off on the socket too); the rule it broke (and it is dropped), or None when it was ingested."""
        try:
            tag, body = split_signed(data)
            report = decode_report(body)
        except WireError as exc:
            self.stats.count(exc.reason)
            log.debug("dropped a datagram: %s", exc)
            return exc.reason
        if network and (refused := self.ranks.refuses(tag, body, report.run)) is not None:
            self.stats.count(refused)
            log.debug("dropped a datagram of run %s: %s", report.run, refused)
            return refused
        if isinstance(report, TimeoutReport):
            log.warning(
                "rank %d of run %s has waited %.0f s in %s on %s",
                report.rank,
                report.run,
                report.waited_s,
                report.op,
                report.dim,
            )
            self.state.ingest_timeout(report)
        elif isinstance(report, ActivityReport):
            log.info("rank %d of run %s: %s", report.rank, report.run, report.activity or "training again")
            self.state.ingest_activity(report, time.time() if now_s is None else now_s)
        else:
            self.state.ingest(report, time.time() if now_s is None else now_s)
        self.stats.count(None)
        return None

    def _receive(self, sock: socket.socket) -> None:
        while not self._stopping.is_set():
            try:
                data = sock.recv(MAX_DATAGRAM_BYTES + 1)
            except TimeoutError:
                continue
            except OSError:
                if self._stopping.is_set():
                    return
                log.exception("agent socket failed; receiving again")
                continue
            self.handle(data, network=sock is self._udp)

    def _expire(self) -> None:
        while not self._stopping.wait(min(self.config.stale_after_s / 4, 30.0)):
            for run, rank in self.state.expire(time.time()):
                log.info("forgot rank %d of run %s: no report for %.0f s", rank, run, self.config.stale_after_s)

    # -- lifecycle -------------------------------------------------------------------------------------------
    @property
    def metrics_port(self) -> int:
        if self._http is None:
            raise RuntimeError("agent not started")
        return int(self._http.server_address[1])

    @property
    def datagram_port(self) -> int:
        if self._udp is None:
            raise RuntimeError("agent not started, or without a datagram port")
        return int(self._udp.getsockname()[1])

    def start(self) -> None:
        """Open the GPU source (one that cannot be opened is said in the metrics, /healthz and the log, and tried again
        later: the rest of the agent runs without it), bind the socket and the HTTP port (errors raise OSError)."""
        cfg = self.config
        table = load_xid_table(cfg.xid_table)
        window = WatchWindow(cfg.xid_window_s, cfg.xid_threshold)
        self.tracing = Tracing(cfg.node)
        self.gpu_access = GpuAccess(cfg.gpu_source, retry_s=cfg.gpu_retry_s)
        self.registry.register(GpuAccessCollector(self.gpu_access, cfg.node))
        self.gpu = GpuHealth(self.gpu_access, table, window, interval_s=cfg.gpu_interval_s, tracer=self.tracing.tracer)
        self.registry.register(GpuHealthCollector(self.gpu, cfg.node))
        self.gpu.start()
        if cfg.controller_url is not None:
            self.reporter = Reporter(cfg.reporter_config(), cfg.node, self.state, self.gpu)
            self.registry.register(ReporterCollector(self.reporter, cfg.node))
            self.reporter.start()
            if cfg.flight_dir:
                self.flight = FlightUploader(cfg.flight_config(), cfg.node)
                self.flight.start()
        if cfg.flight_dir:
            shared_directory(cfg.flight_dir)
        path = self.config.socket
        if os.path.exists(path):
            os.unlink(path)  # a socket file left by an agent that died
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.config.receive_buffer_bytes)
        sock.bind(path)
        os.chmod(path, 0o666)  # the ranks of any user on the node report (training pods rarely run as root)
        sock.settimeout(0.5)
        self._sock = sock
        receivers = [sock]
        if cfg.datagram_port is not None:
            self._udp = udp_socket(cfg.datagram_host, cfg.datagram_port, cfg.receive_buffer_bytes)
            receivers.append(self._udp)
        endpoints = handler(
            metrics=self.metrics_text,
            health=self.health,
            policy=lambda: self.reporter.last_policy if self.reporter is not None else None,
            intake=self.intake,
            gate=self.ranks,
            metrics_tokens=(cfg.metrics_token, cfg.previous_metrics_token) if cfg.metrics_token else (),
        )
        self._http = ThreadingHTTPServer((cfg.metrics_host, cfg.metrics_port), endpoints)
        self._http.daemon_threads = True
        targets = [(f"receive-{i}", lambda r=r: self._receive(r)) for i, r in enumerate(receivers)]
        for name, target in [*targets, ("http", self._http.serve_forever)]:
            thread = threading.Thread(target=target, name=f"opsd-agent-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        expiry = threading.Thread(target=self._expire, name="opsd-agent-expire", daemon=True)
        expiry.start()
        self._threads.append(expiry)
        udp = f" and udp {cfg.datagram_host}:{self.datagram_port}" if self._udp is not None else ""
        log.info("agent %s: datagrams on %s%s, metrics on %s:%d", cfg.node, path, udp, *self._http.server_address[:2])
        if cfg.rank_auth is not RankAuth.OFF and self.ranks.mode is RankAuth.OFF:
            log.warning("agent %s: rank_auth %s without a rank_secret: no run's key is asked", cfg.node, cfg.rank_auth)
        else:
            log.info("agent %s: the run's key is %s over the network", cfg.node, self.ranks.mode.value)

    def stop(self) -> None:
        self._stopping.set()
        if self.reporter is not None:
            self.reporter.stop()
        if self.flight is not None:
            self.flight.stop()
        if self.gpu is not None:
            self.gpu.stop()
        if self.tracing is not None:
            self.tracing.shutdown()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        if self._sock is not None:
            self._sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.socket)
        if self._udp is not None:
            self._udp.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def health(self) -> dict[str, Any]:
        """Alive (the GPUs may be out of reach: ``gpu`` says, and the agent serves its ranks all the same)."""
        gpu = self.gpu_access.status.as_json() if self.gpu_access is not None else None
        return {"status": "ok", "node": self.config.node, "ranks": len(self.state.snapshot()), "gpu": gpu}

    def metrics_text(self) -> bytes:
        return generate_latest(self.registry)


def udp_socket(host: str, port: int, receive_buffer_bytes: int) -> socket.socket:
    """A UDP socket bound to ``host`` (an IPv4 or IPv6 address, "0.0.0.0" or "::" for every one) and ``port``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer_bytes)
    sock.bind((host, port))
    sock.settimeout(0.5)
    return sock
