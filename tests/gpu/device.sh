#!/usr/bin/env bash
# Run the GPU tests and the CUDA memory benchmark on a lent GPU machine (Python 3.12, its own
# torch; Monarch and vLLM are not there). Two steps:
#   here:   bash tests/gpu/device.sh fetch     # wheels for Python 3.12 into .whl/ (git-ignored)
#   device: bash tests/gpu/device.sh run       # with .whl carried; writes $OUT/summary.md
#           (every test by outcome, each benchmark's table), gpu-tests.log/.xml, bench-*.log
set -euo pipefail
cd "$(dirname "$0")/../.."
# The device image has torch (2.11), pytest, pytest-timeout, psutil, nvidia-ml-py, tqdm,
# matplotlib. tests/gpu and bench/memory.py also import torch_memory_saver and (the engines'
# test) transformers; no Monarch, vLLM or pytest-asyncio. `fetch` downloads those two with
# their dependencies; `run` installs only the wheels whose distribution the image lacks.
WHEELS=(torch-memory-saver==0.0.10 transformers==5.19.0)
case "${1:-}" in
  fetch)
    exclude=$(git rev-parse --git-path info/exclude)  # a worktree's .git is a file
    mkdir -p "$(dirname "$exclude")"
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
    python3 -m pip download -q --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform any -d .whl "${WHEELS[@]}" ;;
  run)
    mapfile -t missing < <(python3 - <<'PY'
import importlib.metadata as metadata
import pathlib

for wheel in sorted(pathlib.Path(".whl").glob("*.whl")):
    try:
        metadata.version(wheel.name.split("-")[0])
    except metadata.PackageNotFoundError:
        print(wheel)
PY
)
    python3 -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/site "${missing[@]}"
    export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
    out="${OUT:-runs/gpu}"; mkdir -p "$out"
    nvidia-smi -L
    # every step runs whatever the one before did (a failed test must not hide a
    # benchmark); the limits keep the whole within one 10-minute device call
    status=0
    timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu \
      --junitxml="$out/gpu-tests.xml" 2>&1 | tee "$out/gpu-tests.log" || status=1
    timeout 120 python3 bench/memory.py --device cuda --out "$out/bench_memory_cuda" 2>&1 \
      | tee "$out/bench-memory.log" || status=1
    python3 tests/gpu/summary.py "$out" | tee "$out/summary.md"
    exit "$status" ;;
  *) echo "usage: $0 fetch|run" >&2; exit 2 ;;
esac
