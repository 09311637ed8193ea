"""A real S3 endpoint for tests: moto's server (an HTTP S3 implementation) on loopback, plus a proxy in front of it
that fails chosen requests with 503 SlowDown, to exercise retries."""

from __future__ import annotations

import http.client
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import boto3
from moto.server import ThreadedMotoServer

from opsd.backends.local.processes import free_port

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@contextmanager
def moto_server() -> Iterator[str]:
    """Start moto's S3 server on a free loopback port; yields its endpoint URL."""
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def make_bucket(endpoint: str, bucket: str) -> None:
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket=bucket)


class FlakyProxy:
    """Forwards every request to ``upstream``, except those ``fail(method, path)`` picks, answered with 503."""

    def __init__(self, upstream: str, fail: Callable[[str, str], bool]) -> None:
        self.fail = fail
        self.requests: list[tuple[str, str, int]] = []  # method, path, status sent back
        host, port = upstream.removeprefix("http://").split(":")
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                return None

            def _any(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if proxy.fail(self.command, self.path):
                    # recorded before the answer goes out: the client may act on the answer before this thread runs on
                    proxy.requests.append((self.command, self.path, 503))
                    payload = b"<Error><Code>SlowDown</Code><Message>injected</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection(host, int(port), timeout=30)
                headers = dict(self.headers.items())  # Host included: it is signed (moto does not check it)
                conn.request(self.command, self.path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
                proxy.requests.append((self.command, self.path, response.status))
                self.send_response(response.status)
                for k, v in response.getheaders():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any  # noqa: N815 (http.server's names)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
