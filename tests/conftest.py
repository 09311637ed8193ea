"""Fixtures shared by several test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.s3 import CREDENTIALS, make_bucket, moto_server


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
