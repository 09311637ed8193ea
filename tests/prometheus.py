"""A real Prometheus server (Debian's ``prometheus``, installed by ``make test``) on loopback, for tests.

with PrometheusServer(tmp_path, targets=["127.0.0.1:9464"]) as prom:
    prom.wait_for("opsd_step_seconds", 1)
    prom.query('opsd_mfu_ratio')

Targets that appear later go in a file-based service discovery file (``file_sd``), rewritten with
``write_targets`` as they appear; that job keeps the targets' own labels (``honor_labels``) and adds the file's
(an agent's ``node``), as a production scrape config does; ``ScrapeTargets`` keeps that file in step with a running
``opsd.cli.demo`` (tests/test_demo.py, tools/dashboard_pictures.py).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from opsd.backends.local.processes import free_port
from tests.waiting import wait_for


class PrometheusServer:
    def __init__(
        self,
        workdir: Path,
        targets: list[str],
        scrape_interval_s: float = 1.0,
        file_sd: Path | None = None,
        credentials_file: Path | None = None,
    ) -> None:
        """``credentials_file``: the bearer token the ``file_sd`` job scrapes with (a controller's /metrics wants
        one; agents without a metrics token of their own take the request all the same)."""
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus is not installed (make test installs the Debian package)")
        self.port = free_port()
        config = workdir / "prometheus.yml"
        jobs: list[dict[str, Any]] = []
        if targets:
            jobs.append({"job_name": "opsd-agent", "static_configs": [{"targets": targets}]})
        if file_sd is not None:
            if not file_sd.exists():
                write_targets(file_sd, [])
            discovery = {"files": [str(file_sd)], "refresh_interval": "1s"}
            job: dict[str, Any] = {"job_name": "opsd", "honor_labels": True, "file_sd_configs": [discovery]}
            if credentials_file is not None:
                job["authorization"] = {"credentials_file": str(credentials_file)}
            jobs.append(job)
        interval = f"{round(scrape_interval_s * 1000)}ms"
        config.write_text(
            json.dumps({"global": {"scrape_interval": interval, "evaluation_interval": "1s"}, "scrape_configs": jobs})
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
        def ready() -> bool:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                return r.status == 200

        try:
            wait_for("ready Prometheus", ready, 30, alive=self._proc, retry_on=(OSError,), interval_s=0.1)
        except AssertionError as exc:
            self.__exit__(None, None, None)
            raise RuntimeError(f"{exc}\n{self.log_path.read_text()[-2000:]}") from None
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._log.close()

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The instant vector of ``promql`` (the ``result`` list of the HTTP API)."""
        result: list[dict[str, Any]] = self._get("query", {"query": promql})["result"]
        return result

    def query_range(self, promql: str, start_s: float, end_s: float, step_s: float = 1.0) -> list[dict[str, Any]]:
        """The range vector (matrix) of ``promql`` from ``start_s`` to ``end_s`` (Unix times)."""
        params = {"query": promql, "start": start_s, "end": end_s, "step": step_s}
        result: list[dict[str, Any]] = self._get("query_range", params)["result"]
        return result

    def label_values(self, label: str, match: str, start_s: float, end_s: float) -> list[str]:
        """The values of ``label`` on the series ``match`` selects between ``start_s`` and ``end_s`` (what Grafana's
        ``label_values(match, label)`` lists)."""
        params = {"match[]": match, "start": start_s, "end": end_s}
        values: list[str] = self._get(f"label/{urllib.parse.quote(label)}/values", params)
        return values

    def _get(self, endpoint: str, params: dict[str, Any]) -> Any:
        """The ``data`` of a successful answer; RuntimeError with Prometheus' reason otherwise."""
        url = f"http://127.0.0.1:{self.port}/api/v1/{endpoint}?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as exc:  # a bad query: 400 with the reason in the body
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise RuntimeError(f"{endpoint} {params}: {body.get('error', body)}")
        return body["data"]

    def wait_for(self, promql: str, count: int, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """Poll until ``promql`` returns at least ``count`` series; returns them."""

        def enough() -> list[dict[str, Any]] | None:
            result = self.query(promql)
            return result if len(result) >= count else None

        def found() -> str:
            return f"{len(self.query(promql))} series"

        return wait_for(f"{count} series of {promql!r}", enough, timeout_s, context=found, interval_s=0.25)

    def wait_for_scrapes_after(self, unix_s: float, timeout_s: float = 30.0) -> None:
        """Until every target has been scraped again after ``unix_s``: then every sample taken before it is stored (a
        scrape's samples carry its start time, a target's scrapes run one after the other, and ``up`` is written
        last)."""

        def oldest_scrape_s() -> float:
            oldest = self.query("min(timestamp(up))")
            return float(oldest[0]["value"][1]) if oldest else 0.0

        wait_for(f"scrape of every target after {unix_s:.3f}", lambda: oldest_scrape_s() >= unix_s, timeout_s)


def write_targets(path: Path, groups: list[dict[str, Any]]) -> None:
    """Write a file_sd target file atomically (Prometheus may read it at any moment): a list of
    ``{"targets": ["host:port", ...], "labels": {...}}``."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(groups))
    tmp.replace(path)


class ScrapeTargets:
    """Keeps Prometheus' file_sd targets in step with the demo: the controller (its port from the demo's first line)
    and each node's agent (its port from the line ``opsd agent`` prints into the node's ``agent.log``), with a
    ``node`` label."""

    CONTROLLER = re.compile(r"controller on http://([\w.:-]+)")
    AGENT = re.compile(r"metrics on http://([\w.:-]+)/metrics")

    def __init__(self, stdout: Path, nodes: Path, targets: Path) -> None:
        self.stdout = stdout
        self.nodes = nodes
        self.targets = targets
        self.groups: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="scrape-targets", daemon=True)

    def poll(self) -> None:
        groups: list[dict[str, Any]] = []
        controller = self.CONTROLLER.search(_read(self.stdout))
        if controller:
            groups.append({"targets": [controller.group(1)], "labels": {}})
        for log in sorted(self.nodes.glob("*/agent.log")):
            found = self.AGENT.findall(_read(log))
            if found:
                groups.append({"targets": [found[-1]], "labels": {"node": log.parent.name}})
        if groups != self.groups:
            write_targets(self.targets, groups)
            self.groups = groups

    def _run(self) -> None:
        while not self.stop.wait(0.1):
            self.poll()

    def __enter__(self) -> ScrapeTargets:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
