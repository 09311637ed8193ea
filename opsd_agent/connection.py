"""One keep-alive HTTP connection from the agent to the controller, opened again after an error.

A heartbeat is a few kilobytes every few seconds: a new TCP (and TLS) connection for each would cost the controller
more than taking the heartbeat (at 12,288 nodes, ~1,400 handshakes a second). The controller keeps an idle
connection for ``controller.keep_alive_s`` (30 s), longer than the longest interval it asks for; one it closed
meanwhile is found on the next request, which is sent once more on a new connection.
"""

from __future__ import annotations

import http.client
import ssl
from urllib.parse import urlsplit


class Connection:
    def __init__(self, url: str, timeout_s: float) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http:// or https:// URL: {url!r}")
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.https else 80)
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.timeout_s = timeout_s
        self._conn: http.client.HTTPConnection | None = None

    def _open(self) -> http.client.HTTPConnection:
        if self.https:  # the default context, made when needed: it reads SSL_CERT_FILE as it is then
            context = ssl.create_default_context()
            return http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout_s, context=context)
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)

    def post(self, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        """POST ``body``; (status, reply body). Raises ``OSError`` or ``http.client.HTTPException`` when no answer
        came (the connection is closed then)."""
        reused = self._conn is not None
        try:
            return self._post(body, headers)
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            self.close()
            if not reused:
                raise
        return self._post(body, headers)  # the controller had closed the idle connection: once more, on a new one

    def _post(self, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        if self._conn is None:
            self._conn = self._open()
        conn = self._conn
        try:
            conn.request("POST", self.path, body=body, headers=headers)
            response = conn.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException):
            self.close()
            raise
        if response.will_close:
            self.close()
        return response.status, data

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
