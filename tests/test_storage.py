"""Checkpoint stores: a local directory and S3 (moto's real S3 server on loopback), one behaviour."""

from __future__ import annotations

import pickle
from pathlib import Path

import boto3
import pytest

from opsd.checkpoints.layout import CheckpointStore, inspect_checkpoints, sha256_file
from opsd.checkpoints.local import LocalStore
from opsd.checkpoints.s3 import S3Options, S3Store
from opsd.checkpoints.store import open_store
from opsd.errors import ConfigError, TransientError
from opsd.protocol.manifest import Manifest, ManifestFile, encode_manifest
from tests.s3 import FlakyProxy


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> CheckpointStore:
    if request.param == "file":
        return LocalStore(tmp_path / "root")
    url = request.getfixturevalue("s3_endpoint")
    return S3Store("ckpt", f"runs/{tmp_path.name}", S3Options(endpoint_url=url, spool_dir=str(tmp_path / "spool")))


def write_step(store: CheckpointStore, step: int, files: dict[str, bytes], *, commit: bool = True) -> Manifest:
    """What a save does: DCP's files into ``write_dir``, upload, manifest last."""
    directory = store.write_dir(step)
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    store.upload(step, files)
    entries = [ManifestFile(n, len(d), sha256_file(directory / n)) for n, d in sorted(files.items())]
    store.discard_spool(step, files)
    manifest = Manifest(v=1, step=step, time_unix_s=0.0, world_size=1, mesh={"dp_shard": 1}, files=entries, versions={})
    if commit:
        store.write_manifest(step, encode_manifest(manifest))
    return manifest


def test_committed_torn_and_short_steps_are_told_apart(store: CheckpointStore) -> None:
    files = {".metadata": b"m" * 10, "__0_0.distcp": b"x" * 1000}
    write_step(store, 5, files)
    write_step(store, 10, files)
    write_step(store, 15, files, commit=False)  # shards without a manifest: torn
    found = inspect_checkpoints(store)
    assert [(c.name, c.problem) for c in found] == [
        ("step_000000015", "no manifest (the save did not finish)"),
        ("step_000000010", None),
        ("step_000000005", None),
    ]
    assert found[1].total_bytes == 1010
    assert store.sizes(10) == {".metadata": 10, "__0_0.distcp": 1000}
    path = store.fetch(10, "__0_0.distcp", "reader-a")
    assert path.read_bytes() == b"x" * 1000
    store.forget_read(10, "reader-a")
    store.delete(10)
    assert sorted(store.steps()) == [5, 15]


def rewrite_manifest(store: CheckpointStore, step: int, files: list[ManifestFile]) -> None:
    store.write_manifest(step, encode_manifest(Manifest(1, step, 0.0, 1, {}, files, {})))


def test_a_file_shorter_than_its_manifest_says_is_reported(store: CheckpointStore) -> None:
    manifest = write_step(store, 3, {"__0_0.distcp": b"abc"})
    rewrite_manifest(store, 3, [ManifestFile("__0_0.distcp", 4, manifest.files[0].sha256)])
    (candidate,) = inspect_checkpoints(store)
    assert candidate.problem == "__0_0.distcp: 3 bytes, manifest says 4"


def test_verify_checksums_reads_every_file(store: CheckpointStore) -> None:
    write_step(store, 1, {"__0_0.distcp": b"abc"})
    rewrite_manifest(store, 1, [ManifestFile("__0_0.distcp", 3, "0" * 64)])
    assert inspect_checkpoints(store)[0].problem is None  # sizes agree
    assert inspect_checkpoints(store, verify_checksums=True)[0].problem == "__0_0.distcp: checksum mismatch"


def test_large_files_go_up_in_parallel_parts(s3_endpoint: str, tmp_path: Path) -> None:
    options = S3Options(
        endpoint_url=s3_endpoint,
        multipart_threshold_bytes=5 << 20,
        multipart_chunk_bytes=5 << 20,
        max_concurrency=4,
        spool_dir=str(tmp_path),
    )
    store = S3Store("ckpt", "multipart", options)
    data = bytes(range(256)) * (12 << 12)  # 12 MiB: three parts of 5, 5 and 2 MiB
    write_step(store, 1, {"__0_0.distcp": data, "__1_0.distcp": b"small"})
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    head = client.head_object(Bucket="ckpt", Key="multipart/step_000000001/__0_0.distcp")
    assert head["ETag"].strip('"').endswith("-3")  # S3's mark of a 3-part upload
    small = client.head_object(Bucket="ckpt", Key="multipart/step_000000001/__1_0.distcp")
    assert "-" not in small["ETag"]
    assert store.fetch(1, "__0_0.distcp", "r").read_bytes() == data
    assert not store.write_dir(1).exists()  # the spool is emptied after the upload


def test_transient_failures_are_retried_with_backoff(s3_endpoint: str, tmp_path: Path) -> None:
    failures = {"PUT": 2}

    def fail(method: str, path: str) -> bool:
        if failures.get(method, 0) > 0:
            failures[method] -= 1
            return True
        return False

    proxy = FlakyProxy(s3_endpoint, fail)
    try:
        store = S3Store("ckpt", "flaky", S3Options(endpoint_url=proxy.url, max_attempts=4, spool_dir=str(tmp_path)))
        write_step(store, 7, {"__0_0.distcp": b"payload"})
        assert [s for m, _, s in proxy.requests if m == "PUT"][:3] == [503, 503, 200]
        assert inspect_checkpoints(store)[0].problem is None
    finally:
        proxy.close()


def test_a_store_that_keeps_failing_gives_a_transient_error(s3_endpoint: str, tmp_path: Path) -> None:
    proxy = FlakyProxy(s3_endpoint, lambda method, path: True)
    try:
        store = S3Store("ckpt", "down", S3Options(endpoint_url=proxy.url, max_attempts=3, spool_dir=str(tmp_path)))
        with pytest.raises(TransientError, match="SlowDown"):
            store.steps()
        assert len(proxy.requests) == 3  # max_attempts in all
    finally:
        proxy.close()


def test_an_s3_store_pickles_without_its_client(s3_endpoint: str, tmp_path: Path) -> None:
    store = S3Store("ckpt", "p", S3Options(endpoint_url=s3_endpoint, spool_dir=str(tmp_path)))
    copy = pickle.loads(pickle.dumps(store))
    assert (copy.bucket, copy.prefix, copy.options, copy.url) == ("ckpt", "p", store.options, "s3://ckpt/p")
    assert copy.steps() == []


@pytest.mark.parametrize(
    ("url", "message"),
    [("gs://bucket/x", "supported schemes"), ("s3:///prefix", "no bucket")],
    ids=["scheme", "bucket"],
)
def test_bad_urls_are_refused(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        open_store(url)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_attempts": 0}, "max_attempts must be >= 1"),
        ({"multipart_chunk_bytes": 1 << 20}, "5 MiB"),
        ({"multipart_threshold_bytes": 5 << 20, "multipart_chunk_bytes": 8 << 20}, "threshold"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"endpoint_url": "localhost:9000"}, "http:// or https://"),
    ],
    ids=["attempts", "chunk", "threshold", "concurrency", "s3_endpoint"],
)
def test_s3_options_validate_themselves(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        S3Options(**options)  # type: ignore[arg-type]


def test_plain_paths_and_file_urls_are_local(tmp_path: Path) -> None:
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    store = open_store(f"file://{tmp_path}")
    assert isinstance(store, LocalStore)
    assert store.root == tmp_path
