"""The controller's API over HTTPS (controller.tls_certfile, tls_keyfile): a real uvicorn with a certificate of a CA
made here; an agent's heartbeats and the CLI trust that CA through SSL_CERT_FILE (what the chart sets from the
certificate's Secret), and refuse the server without it."""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from typer.testing import CliRunner

from opsd.api.auth import Credentials
from opsd.api.tls import CertificateReload
from opsd.backends.local.processes import free_port
from opsd.cli.app import app
from opsd.controller.controller import Controller
from opsd.controller.state import StateStore
from opsd.protocol.heartbeat import encode
from opsd.runtime.config import ServeConfig
from opsd.runtime.server import Serving
from opsd_agent.reporter import Reporter, ReporterConfig
from opsd_agent.state import NodeState
from tests.test_agent import step
from tests.waiting import wait_for

OPERATOR, AGENT = "tls-operator", "tls-agent"


def certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[str, ec.EllipticCurvePrivateKey] | None,
    names: list[x509.GeneralName] | None = None,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, issuer_key = issuer if issuer is not None else (subject, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def pem(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.fixture
def https(tmp_path: Path) -> Iterator[tuple[str, Path, Controller]]:
    """The API on https://localhost:<port>, its CA's certificate, its controller."""
    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = certificate("opsd test CA", ca_key, None)
    names: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    leaf = certificate("opsd-controller", server_key, ("opsd test CA", ca_key), names)
    encoding = serialization.Encoding.PEM
    key_pem = server_key.private_bytes(encoding, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    config = ServeConfig(
        host="127.0.0.1",
        port=free_port(),
        liveness_port=0,
        heartbeat_port=0,
        state_dir=str(tmp_path / "state"),
        tls_certfile=str(pem(tmp_path / "tls.crt", leaf.public_bytes(encoding))),
        tls_keyfile=str(pem(tmp_path / "tls.key", key_pem)),
    )
    controller = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"))
    serving = Serving(config, controller, Credentials(operator=OPERATOR, agent=AGENT))
    serving.start()  # the API alone: the test drives the controller
    try:
        yield f"https://localhost:{config.port}", pem(tmp_path / "ca.crt", ca.public_bytes(encoding)), controller
    finally:
        serving.close()


def test_agents_and_the_cli_speak_https_to_a_controller_whose_ca_they_trust(
    https: tuple[str, Path, Controller], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, ca, controller = https
    state = NodeState()
    state.ingest(step(rank=0, step=5), now_s=time.time())
    reporter = Reporter(ReporterConfig(url=f"{url}/v1/heartbeat", token=AGENT), "n1", state, None)
    assert not reporter.send_once(time.time())  # the CA unknown: refused
    assert reporter.sent_failed == 1
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))
    assert reporter.send_once(time.time())
    assert controller.store.run("r") is not None
    # the heartbeat process speaks HTTPS too, with the same certificate: it answers the node once it is told of it
    assert reporter.apart is not None
    assert reporter.apart.https
    body = encode(reporter.heartbeat(time.time()))
    context = ssl.create_default_context(cafile=str(ca))

    def answered_apart() -> bool:
        assert reporter.apart is not None
        conn = http.client.HTTPSConnection("localhost", reporter.apart.port, timeout=10, context=context)
        try:
            conn.request("POST", "/v1/heartbeat", body=body, headers={"Authorization": f"Bearer {AGENT}"})
            response = conn.getresponse()
            response.read()
            return response.status == 200  # else 421 until told
        finally:
            conn.close()

    wait_for("a heartbeat answered over HTTPS by the heartbeat process", answered_apart, 10)
    cli = CliRunner().invoke(app, ["runs", "--json", "--url", url, "--token", OPERATOR], env={"SSL_CERT_FILE": str(ca)})
    assert cli.exit_code == 0, cli.output
    assert '"id": "r"' in cli.stdout  # the run of the step the agent's heartbeat carried


class SecretVolume:
    """A Secret mounted as a volume, written as the kubelet writes it: the files in a directory of their own, which a
    ``..data`` link names, swapped at once for the next (``tls.crt`` and ``tls.key`` are links through ``..data``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.writes = 0
        root.mkdir(parents=True, exist_ok=True)

    def write(self, files: dict[str, bytes]) -> None:
        self.writes += 1
        version = self.root / f"..2026_11_29_{self.writes:04d}"
        version.mkdir()
        for name, data in files.items():
            (version / name).write_bytes(data)
        link = self.root / "..data_tmp"
        link.symlink_to(version.name)
        link.rename(self.root / "..data")
        for name in files:
            if not (self.root / name).is_symlink():
                (self.root / name).symlink_to(f"..data/{name}")


def issued(ca: tuple[str, ec.EllipticCurvePrivateKey]) -> tuple[x509.Certificate, bytes]:
    """A server certificate for localhost from ``ca``, and its key (PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return certificate("opsd-controller", key, ca, names), key_pem


def served_serial(port: int, context: ssl.SSLContext) -> int:
    """The serial number of the certificate a new connection to ``port`` is served."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=5)
    with context.wrap_socket(raw, server_hostname="localhost") as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def test_a_renewed_certificate_is_served_without_a_restart_by_the_api_and_the_heartbeat_process(
    tmp_path: Path,
) -> None:
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = certificate("opsd test CA", ca_key, None)
    pem_of = serialization.Encoding.PEM
    volume = SecretVolume(tmp_path / "tls")
    first, first_key = issued(("opsd test CA", ca_key))
    volume.write({"tls.crt": first.public_bytes(pem_of), "tls.key": first_key})
    config = ServeConfig(
        host="127.0.0.1",
        port=free_port(),
        liveness_port=0,
        heartbeat_port=free_port(),
        state_dir=str(tmp_path / "state"),
        tls_certfile=str(volume.root / "tls.crt"),
        tls_keyfile=str(volume.root / "tls.key"),
        tls_reload_every_s=0.1,
    )
    controller = Controller(StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}"))
    serving = Serving(config, controller, Credentials(operator=OPERATOR, agent=AGENT))
    serving.start()
    trusting = ssl.create_default_context(cadata=ca.public_bytes(pem_of).decode())
    assert config.heartbeat_port is not None
    ports: dict[str, int] = {"api": config.port, "heartbeats": config.heartbeat_port}

    def serial_of(port: int, wanted: int = 0) -> Callable[[], int | bool]:
        """The serial served on ``port``; with ``wanted``: whether it is that one."""
        return lambda: served_serial(port, trusting) == wanted if wanted else served_serial(port, trusting)

    try:
        for where, port in ports.items():
            served = wait_for(f"the {where} over HTTPS", serial_of(port), 20, retry_on=(OSError,))
            assert served == first.serial_number, where
        renewed, renewed_key = issued(("opsd test CA", ca_key))
        volume.write({"tls.crt": renewed.public_bytes(pem_of), "tls.key": renewed_key})
        for where, port in ports.items():
            wait_for(f"the {where} serving the renewed certificate", serial_of(port, renewed.serial_number), 10)
        # a certificate written without its key (a broken renewal): the renewed one is still served
        broken, _ = issued(("opsd test CA", ca_key))
        volume.write({"tls.crt": broken.public_bytes(pem_of), "tls.key": renewed_key})
        time.sleep(1.0)  # ten checks
        assert {where: served_serial(port, trusting) for where, port in ports.items()} == dict.fromkeys(
            ports, renewed.serial_number
        )
    finally:
        serving.close()


def test_a_pair_that_does_not_load_is_counted_and_the_served_one_kept(tmp_path: Path) -> None:
    ca_key = ec.generate_private_key(ec.SECP256R1())
    volume = SecretVolume(tmp_path / "tls")
    first, first_key = issued(("opsd test CA", ca_key))
    pem_of = serialization.Encoding.PEM
    volume.write({"tls.crt": first.public_bytes(pem_of), "tls.key": first_key})
    certfile, keyfile = str(volume.root / "tls.crt"), str(volume.root / "tls.key")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certfile, keyfile)
    reload = CertificateReload(context, certfile, keyfile)
    assert not reload.check()  # unchanged
    other, other_key = issued(("opsd test CA", ca_key))
    volume.write({"tls.crt": other.public_bytes(pem_of), "tls.key": first_key})
    assert (reload.check(), reload.failures, reload.reloads) == (False, 1, 0)
    assert not reload.check()  # the same broken pair is not tried again
    volume.write({"tls.crt": other.public_bytes(pem_of), "tls.key": other_key})
    assert (reload.check(), reload.failures, reload.reloads) == (True, 1, 1)
