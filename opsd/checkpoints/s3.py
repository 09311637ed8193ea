"""A checkpoint store under an S3 prefix (``s3://bucket/prefix``), through boto3: DCP writes into a local spool,
each rank uploads its own files (boto3's managed transfer: multipart above a threshold, parts in parallel,
retries with exponential backoff); the manifest is committed by a single PUT.

The endpoint is configurable (``S3Options.endpoint_url``, or boto3's own ``AWS_ENDPOINT_URL_S3`` /
``AWS_ENDPOINT_URL``), so any S3-compatible store works; credentials come from boto3's usual chain. This is the
one module that imports boto3; its errors become opsd's (``TransientError``, ``PermanentError``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from opsd.checkpoints.layout import STEP_DIR, step_dir_name
from opsd.errors import PermanentError, TransientError
from opsd.protocol.manifest import MANIFEST_NAME

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class S3Options:
    """How to reach the store and how to move data. ``endpoint_url`` None: boto3's default (AWS, or the
    ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` environment variables)."""

    endpoint_url: str | None = None
    region: str | None = None
    max_attempts: int = 8  # attempts in all per request; botocore "standard" mode: exponential backoff, jitter
    multipart_threshold_bytes: int = 64 << 20
    multipart_chunk_bytes: int = 16 << 20
    max_concurrency: int = 8  # parts (and files) in flight per rank
    spool_dir: str = ""  # local directory for DCP's files before upload and downloads ("": the temp directory)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("s3.max_attempts must be >= 1")
        if self.multipart_chunk_bytes < 5 << 20:
            raise ValueError("s3.multipart_chunk_bytes must be >= 5 MiB (S3's smallest part)")
        if self.multipart_threshold_bytes < self.multipart_chunk_bytes:
            raise ValueError("s3.multipart_threshold_bytes must be >= s3.multipart_chunk_bytes")
        if self.max_concurrency < 1:
            raise ValueError("s3.max_concurrency must be >= 1")
        if self.endpoint_url is not None and urlparse(self.endpoint_url).scheme not in ("http", "https"):
            raise ValueError(f"s3.endpoint_url {self.endpoint_url!r} must be an http:// or https:// URL")


class S3Store:
    """``s3://bucket/prefix`` through boto3: DCP writes into a local spool, each rank uploads its own files."""

    def __init__(self, bucket: str, prefix: str, options: S3Options | None = None) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.options = options or S3Options()
        self.client = boto3.session.Session().client(
            "s3",
            endpoint_url=self.options.endpoint_url,
            region_name=self.options.region,
            config=Config(
                retries={"total_max_attempts": self.options.max_attempts, "mode": "standard"},
                max_pool_connections=max(10, 2 * self.options.max_concurrency),
            ),
        )
        self.transfer = TransferConfig(
            multipart_threshold=self.options.multipart_threshold_bytes,
            multipart_chunksize=self.options.multipart_chunk_bytes,
            max_concurrency=self.options.max_concurrency,
        )
        base = Path(self.options.spool_dir or tempfile.gettempdir()) / "opsd-spool" / bucket
        self.spool = base / self.prefix if self.prefix else base

    def __getstate__(self) -> dict[str, Any]:
        return {"bucket": self.bucket, "prefix": self.prefix, "options": self.options}  # a client does not pickle

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["bucket"], state["prefix"], state["options"])  # type: ignore[misc]

    def _key(self, step: int, name: str = "") -> str:
        parts = [p for p in (self.prefix, step_dir_name(step), name) if p]
        return "/".join(parts)

    def _call(self, what: str, fn: Any, **kwargs: Any) -> Any:
        """One S3 call, its failures turned into opsd's errors (botocore has already retried transient ones)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(**kwargs)
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            if status >= 500 or code in ("SlowDown", "RequestTimeout", "Throttling"):
                raise TransientError(f"{self.url}: {what}: {code} ({status})", retry_after_s=1.0) from exc
            raise PermanentError(f"{self.url}: {what}: {code} ({status})") from exc
        except BotoCoreError as exc:
            raise TransientError(f"{self.url}: {what}: {exc}", retry_after_s=1.0) from exc

    def _list(self, prefix: str, delimiter: str = "") -> Iterable[dict[str, Any]]:
        paginator = self.client.get_paginator("list_objects_v2")
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
        if delimiter:
            kwargs["Delimiter"] = delimiter
        pages: list[dict[str, Any]] = self._call("list", lambda **kw: list(paginator.paginate(**kw)), **kwargs)
        return pages

    def steps(self) -> list[int]:
        base = f"{self.prefix}/" if self.prefix else ""
        out = []
        for page in self._list(base, "/"):
            for common in page.get("CommonPrefixes", []):
                name = common["Prefix"][len(base) :].rstrip("/")
                if match := STEP_DIR.match(name):
                    out.append(int(match.group(1)))
        return out

    def read_manifest(self, step: int) -> bytes | None:
        from botocore.exceptions import ClientError

        def get() -> bytes | None:
            try:
                response = self.client.get_object(Bucket=self.bucket, Key=self._key(step, MANIFEST_NAME))
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    return None
                raise
            data: bytes = response["Body"].read()
            return data

        result: bytes | None = self._call("get manifest", get)
        return result

    def sizes(self, step: int) -> dict[str, int]:
        base = self._key(step) + "/"
        return {
            obj["Key"][len(base) :]: int(obj["Size"])
            for page in self._list(base)
            for obj in page.get("Contents", [])
            if obj["Key"][len(base) :] != MANIFEST_NAME
        }

    def write_dir(self, step: int) -> Path:
        return self.spool / "write" / step_dir_name(step)

    def upload(self, step: int, names: Iterable[str]) -> None:
        directory = self.write_dir(step)

        def one(name: str) -> None:
            self._call(
                f"upload {name}",
                self.client.upload_file,
                Filename=str(directory / name),
                Bucket=self.bucket,
                Key=self._key(step, name),
                Config=self.transfer,
            )

        todo = sorted(set(names))
        with ThreadPoolExecutor(max_workers=min(len(todo), self.options.max_concurrency) or 1) as pool:
            for future in [pool.submit(one, name) for name in todo]:
                future.result()

    def discard_spool(self, step: int, names: Iterable[str]) -> None:
        directory = self.write_dir(step)
        for name in names:
            (directory / name).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            directory.rmdir()  # the last rank on this node to finish removes it

    def write_manifest(self, step: int, data: bytes) -> None:
        self._call(
            "put manifest",
            self.client.put_object,
            Bucket=self.bucket,
            Key=self._key(step, MANIFEST_NAME),
            Body=data,
            ContentType="application/json",
        )

    def read_dir(self, step: int, reader: str) -> Path:
        return self.spool / "read" / reader / step_dir_name(step)

    def fetch(self, step: int, name: str, reader: str) -> Path:
        path = self.read_dir(step, reader) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.part")
        self._call(
            f"download {name}",
            self.client.download_file,
            Bucket=self.bucket,
            Key=self._key(step, name),
            Filename=str(tmp),
            Config=self.transfer,
        )
        os.replace(tmp, path)
        return path

    def forget_read(self, step: int, reader: str) -> None:
        shutil.rmtree(self.read_dir(step, reader), ignore_errors=True)

    def delete(self, step: int) -> None:
        self._call("delete manifest", self.client.delete_object, Bucket=self.bucket, Key=self._key(step, MANIFEST_NAME))
        keys = [obj["Key"] for page in self._list(self._key(step) + "/") for obj in page.get("Contents", [])]
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1,000 keys
            batch = {"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True}
            self._call("delete", self.client.delete_objects, Bucket=self.bucket, Delete=batch)
