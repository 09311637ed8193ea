"""Fixtures shared by several test modules."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from typing import TYPE_CHECKING

import pytest

from tests import launch
from tests.s3 import CREDENTIALS, make_bucket, moto_server

if TYPE_CHECKING:
    from pathlib import Path

    from opsd.controller.state import StateStore
    from tests.helm_chart import Combo, Helm, Obj
    from tests.kube.emulator import KubeEmulator
    from trainer_hooks.collectives import CollectiveTracer


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server on loopback with a bucket named ``ckpt``; boto3's credentials set for this process (and
    so for the processes it starts)."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in CREDENTIALS.items():
            mp.setenv(k, v)
        with moto_server() as url:
            make_bucket(url, "ckpt")
            yield url


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A real PostgreSQL server on loopback for the session (Debian's postgresql)."""
    from tests.postgres import postgres_server

    with postgres_server() as url:
        yield url


@pytest.fixture
def store(tmp_path: Path) -> StateStore:
    """A controller's state store on SQLite, fresh for each test (a module may name its own ``store``)."""
    from opsd.controller.state import StateStore

    return StateStore.open(f"sqlite:///{tmp_path / 'opsd.db'}")


@pytest.fixture(scope="session")
def helm() -> Helm:
    """A real helm v4 (``tests.helm_chart.find_helm``: .venv/bin/helm, $OPSD_HELM or PATH); the test is skipped
    without one."""
    from tests.helm_chart import Helm, find_helm

    path = find_helm()
    if path is None:
        pytest.skip("no helm: run `python tools/install_helm.py .venv/bin/helm` (make does), or set OPSD_HELM")
    return Helm(path)


@pytest.fixture(scope="session")
def renders(helm: Helm) -> dict[Combo, list[Obj]]:
    """The chart rendered for every combination of its matrix (``tests.helm_chart.COMBOS``), once for the session
    (two at a time: helm is quick, the machine is small)."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.helm_chart import COMBOS, values_args

    def one(combo: Combo) -> list[Obj]:
        return helm.render(*values_args(combo.values), kube=combo.kube, api=combo.api)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(COMBOS, pool.map(one, COMBOS), strict=True))


@pytest.fixture(scope="session")
def default(renders: dict[Combo, list[Obj]]) -> list[Obj]:
    """The chart rendered with its default values, for the newest Kubernetes, with the Prometheus Operator's API."""
    from tests.helm_chart import DEFAULT

    return renders[DEFAULT]


@pytest.fixture
def cleanup() -> Iterator[ExitStack]:
    """What a test started that must be closed at its end, failed or not (``cleanup.callback(cluster.close)``): the
    last started is closed first, and each is closed even when one before it failed to."""
    with ExitStack() as stack:
        yield stack


@pytest.fixture
def kube() -> Iterator[KubeEmulator]:
    """An emulated Kubernetes API server on loopback (``tests.kube.emulator``), fresh for each test."""
    from tests.kube.emulator import kube_emulator

    with kube_emulator() as emulator:
        yield emulator


@pytest.fixture
def gloo_world() -> Iterator[None]:
    """A gloo world of one: this process."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import HashStore  # type: ignore[attr-defined]

    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def tracer(gloo_world: None) -> Iterator[CollectiveTracer]:
    """A collective tracer installed in a gloo world of one (this process)."""
    from trainer_hooks.collectives import CollectiveTracer

    t = CollectiveTracer()
    t.install()
    try:
        yield t
    finally:
        t.uninstall()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Every launch run again for a known crash (tests/launch.py), and the verdict on the session's budget."""
    if not launch.RETRIES:
        return
    terminalreporter.section("launches run again for a known crash")
    verdict = launch.over_budget(launch.RETRIES)
    if verdict is not None:
        terminalreporter.write_line(verdict, red=True)
        return
    for retry in launch.RETRIES:
        terminalreporter.write_line(f"{retry.cause.name}: {retry.root_cause}; {retry.command}")
    terminalreporter.write_line(f"{len(launch.RETRIES)} of a budget of {launch.RETRY_BUDGET}")


def pytest_sessionfinish(session: pytest.Session) -> None:
    """More relaunches than ``RETRY_BUDGET`` fail the session, even when every test passed."""
    if launch.over_budget(launch.RETRIES) is not None and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
