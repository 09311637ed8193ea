"""The API's certificate loaded again when its files change: cert-manager renews a certificate by rewriting its
Secret, and the kubelet swaps the files of the Secret's volume in place (a symbolic link changed at once, the
certificate and its key together); a server that loaded them once serves the old certificate until it expires, and
then every agent's heartbeat fails.

    reload = CertificateReload(context, "/etc/opsd/tls/tls.crt", "/etc/opsd/tls/tls.key")
    task = asyncio.create_task(reload.every(10.0))   # in the event loop that makes the server's handshakes

The files are read every ``every_s``; when what they hold changed, the pair is loaded into the same
``ssl.SSLContext``, which every later handshake uses (a connection already open keeps the certificate it had). The
check runs in the server's event loop, so that a context is never changed under a handshake. A pair that does not
load (a key that is not the certificate's, a file written half) is logged, counted in ``failures``, and the pair
served so far kept (it is tried in a context of its own first); it is tried again once its files change again.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import ssl
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


class CertificateReload:
    def __init__(self, context: ssl.SSLContext, certfile: str, keyfile: str) -> None:
        self.context = context
        self.certfile = certfile
        self.keyfile = keyfile
        self.reloads = 0
        self.failures = 0
        pair = self._read()
        self._seen = _digest(pair) if pair is not None else ""

    def _read(self) -> tuple[bytes, bytes] | None:
        """What the two files hold now (None when one cannot be read: a swap in progress)."""
        try:
            return Path(self.certfile).read_bytes(), Path(self.keyfile).read_bytes()
        except OSError:
            return None

    def check(self) -> bool:
        """Load the pair again if its files changed since they were last seen; whether it was loaded."""
        pair = self._read()
        if pair is None:
            return False
        seen = _digest(pair)
        if seen == self._seen:
            return False
        self._seen = seen
        try:
            self._load(*pair)
        except (ssl.SSLError, OSError) as exc:
            self.failures += 1
            log.warning("TLS certificate %s changed but does not load (the one served kept): %s", self.certfile, exc)
            return False
        self.reloads += 1
        log.info("TLS certificate %s loaded again: later connections are served the new one", self.certfile)
        return True

    def _load(self, certificate: bytes, key: bytes) -> None:
        """Load the pair read into the served context, once a context of its own took it: a failed load leaves a
        context half changed (the new certificate with the old key), which no handshake survives. Both loads read
        the same copy, private to this process, not the files, which may change in between."""
        with tempfile.TemporaryDirectory(prefix="opsd-tls-") as scratch:
            certfile, keyfile = Path(scratch) / "tls.crt", Path(scratch) / "tls.key"
            certfile.write_bytes(certificate)
            keyfile.write_bytes(key)
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(certfile, keyfile)
            self.context.load_cert_chain(certfile, keyfile)

    async def every(self, every_s: float) -> None:
        """``check`` every ``every_s`` until cancelled."""
        while True:
            await asyncio.sleep(every_s)
            self.check()


def _digest(pair: tuple[bytes, bytes]) -> str:
    return hashlib.sha256(b"\0".join(pair)).hexdigest()
