"""Where checkpoints live: ``open_store`` gives the store of a checkpoint URL: a local directory (``file:///path``
or a plain path: ``opsd.checkpoints.local``) or an S3 prefix (``s3://bucket/prefix``: ``opsd.checkpoints.s3``), one
layout (``opsd.checkpoints.layout``)."""

from __future__ import annotations

import logging
from pathlib import Path
from urllib.parse import urlparse

from opsd.checkpoints.layout import CheckpointStore, inspect_checkpoints
from opsd.checkpoints.local import LocalStore
from opsd.checkpoints.s3 import S3Options, S3Store
from opsd.errors import ConfigError, OpsError

log = logging.getLogger(__name__)


def open_store(url: str, s3: S3Options | None = None) -> CheckpointStore:
    """The store for a checkpoint URL: ``file:///path``, a plain path, or ``s3://bucket[/prefix]``."""
    if url.startswith("s3://"):
        parsed = urlparse(url)
        if not parsed.netloc:
            raise ConfigError(f"checkpoint URL {url!r}: no bucket (expected s3://bucket/prefix)")
        return S3Store(parsed.netloc, parsed.path, s3)
    if "://" in url and not url.startswith("file://"):
        raise ConfigError(f"checkpoint URL {url!r}: supported schemes are file://, s3:// (or a plain path)")
    return LocalStore(Path(url.removeprefix("file://")))


def newest_checkpoint(url: str) -> int | None:
    """The newest committed checkpoint step at ``url`` (None: none, or the store cannot be read)."""
    try:
        found = inspect_checkpoints(open_store(url))
    except OpsError as exc:
        log.warning("cannot look at the checkpoints at %s: %s", url, exc)
        return None
    return next((c.step for c in found if c.problem is None), None)
