"""A real Prometheus server (Debian's ``prometheus``, installed by ``make test``) on loopback, for tests.

with PrometheusServer(tmp_path, targets=["127.0.0.1:9464"]) as prom:
    prom.wait_for_scrape("opsd_step_seconds")
    prom.query('opsd_mfu_ratio')
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from opsd.local import free_port


class PrometheusServer:
    def __init__(self, workdir: Path, targets: list[str], scrape_interval_s: float = 1.0) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus is not installed (make test installs the Debian package)")
        self.port = free_port()
        config = workdir / "prometheus.yml"
        config.write_text(
            json.dumps(
                {
                    "global": {"scrape_interval": f"{round(scrape_interval_s * 1000)}ms", "evaluation_interval": "1s"},
                    "scrape_configs": [{"job_name": "opsd-agent", "static_configs": [{"targets": targets}]}],
                }
            )
        )
        self._log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115 - closed in __exit__
        self._proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.log_path = workdir / "prometheus.log"

    def __enter__(self) -> PrometheusServer:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self._proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.1)
        self.__exit__(None, None, None)
        raise RuntimeError(f"prometheus did not become ready:\n{self.log_path.read_text()[-2000:]}")

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._log.close()

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The instant vector of ``promql`` (the ``result`` list of the HTTP API)."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        if body["status"] != "success":
            raise RuntimeError(f"query {promql!r} failed: {body}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def wait_for(self, promql: str, count: int, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """Poll until ``promql`` returns at least ``count`` series; returns them."""
        deadline = time.monotonic() + timeout_s
        result: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            result = self.query(promql)
            if len(result) >= count:
                return result
            time.sleep(0.25)
        raise AssertionError(f"{promql!r}: {len(result)} series after {timeout_s} s, wanted {count}")
