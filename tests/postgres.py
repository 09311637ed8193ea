"""A real PostgreSQL server for tests: Debian's ``postgresql`` binaries, a fresh cluster in a temporary directory,
listening on a free loopback port, trust authentication. Run as the ``postgres`` user when the tests run as root
(PostgreSQL refuses to run as root)."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from opsd.backends.local.processes import free_port


def bindir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _as_postgres(cmd: list[str]) -> list[str]:
    if os.getuid() != 0:
        return cmd
    return ["runuser", "-u", "postgres", "--", *cmd]


@contextmanager
def postgres_server() -> Iterator[str]:
    """Yields a SQLAlchemy URL of the ``postgres`` database of a fresh server; stops and removes it afterwards."""
    bins = bindir()
    if bins is None:
        raise RuntimeError("PostgreSQL is not installed (Debian package postgresql; `make test` installs it)")
    workdir = Path(tempfile.mkdtemp(prefix="opsd-pg-"))
    if os.getuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(workdir, user.pw_uid, user.pw_gid)
    data = workdir / "data"
    port = free_port()
    try:
        subprocess.run(
            _as_postgres([str(bins / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8"]),
            check=True,
            capture_output=True,
        )
        options = f"-p {port} -k {workdir} -c listen_addresses=127.0.0.1 -c fsync=off"
        subprocess.run(
            _as_postgres(
                [str(bins / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(workdir / "log"), "-w", "start"]
            ),
            check=True,
            capture_output=True,
        )
        try:
            yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
        finally:
            subprocess.run(
                _as_postgres([str(bins / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"]), capture_output=True
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
