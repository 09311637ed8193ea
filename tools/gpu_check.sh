#!/usr/bin/env bash
# Every GPU figure of opsd, on a machine with a GPU and no network (docs/gpu.md), from a copy of the project: that
# machine has python3 with torch, nvidia-ml-py, prometheus-client and numpy, but not msgspec, which the trainer hooks
# need. `make gpu-wheels` downloads its wheel (for CPython 3.12, x86_64) into gpu-wheels/ here; this script installs
# what it finds there, offline, into a temporary directory, then runs `python3 -m bench.gpu_check` with the
# arguments it was given. Usage: tools/gpu_check.sh [bench.gpu_check arguments...]; GPU_WHEELS=DIR for another
# folder of wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=${GPU_WHEELS:-gpu-wheels}
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
if compgen -G "$wheels/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/*.whl
fi
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -m bench.gpu_check "$@"
