"""Draw the dashboards as pictures from the demo: run ``opsd.cli.demo`` (an XID on a node of a 4-rank job,
detected, the node swapped for the spare, the run resumed and completed) while a real Prometheus (Debian's, as the
tests use it) scrapes its controller and agents, then draw the dashboards from what Prometheus holds
(``opsd.dashboards.render``, the panels' own queries)::

    .venv/bin/python -m tools.dashboard_pictures docs/img              # Training and Reliability
    .venv/bin/python -m tools.dashboard_pictures docs/img --all        # all five

Writes ``DIR/dashboard-<name>.png``; exit status 1 when the demo fails.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from opsd.cli.demo import RUN
from opsd.dashboards.build import build_all
from opsd.dashboards.render import PrometheusReader, RenderConfig, render_all
from tests.prometheus import PrometheusServer, ScrapeTargets

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
SCRAPE_INTERVAL_S = 1.0
RATE_INTERVAL = "5s"  # Grafana's $__rate_interval at a 1 s scrape interval (4 scrapes)
DEFAULT_DASHBOARDS = ("training", "reliability")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.dashboard_pictures", description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="directory for dashboard-<name>.png")
    p.add_argument("--all", action="store_true", help="all five dashboards, not only Training and Reliability")
    p.add_argument("--steps", type=int, default=80, help="the demo's steps")
    p.add_argument("--timeout-s", type=float, default=280.0, help="the demo's time limit (a loaded machine: more)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory(prefix="opsd-pictures-") as tmp:
        work, prom_dir = Path(tmp) / "demo", Path(tmp) / "prometheus"
        prom_dir.mkdir()
        stdout = Path(tmp) / "demo.out"
        targets = prom_dir / "targets.json"
        with PrometheusServer(
            prom_dir,
            targets=[],
            scrape_interval_s=SCRAPE_INTERVAL_S,
            file_sd=targets,
            credentials_file=work / "state" / "token",  # the demo controller's token: its /metrics wants it
        ) as prom:
            started = time.time()
            command = [sys.executable, "-m", "opsd.cli.demo", "--workdir", str(work), "--steps", str(args.steps)]
            command += ["--timeout-s", str(args.timeout_s)]
            with stdout.open("wb") as out, ScrapeTargets(stdout, work / "runs" / RUN / "nodes", targets):
                returncode = subprocess.run(command, cwd=ROOT, stdout=out, check=False).returncode
            ended = time.time()
            if returncode != 0:
                print(f"the demo failed (exit {returncode}):\n{stdout.read_text()[-3000:]}", file=sys.stderr)
                return 1
            prom.wait_for_scrapes_after(ended)  # every sample of the run in
            boards = build_all()
            names = list(boards) if args.all else list(DEFAULT_DASHBOARDS)
            config = RenderConfig(RUN, started, ended, step_s=2.0, rate_interval=RATE_INTERVAL, dpi=64)
            pictures = render_all(boards, PrometheusReader(f"http://127.0.0.1:{prom.port}"), config, names)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, picture in pictures.items():
        path = args.out / f"dashboard-{name}.png"
        path.write_bytes(picture.png)
        empty = [p.title for p in picture.panels if not p.points]
        print(f"{path}: {len(picture.png) // 1024} KiB, {len(picture.panels)} panels, no data: {empty or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
