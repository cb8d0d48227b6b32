#!/usr/bin/env bash
# Run the GPU tests and the CUDA memory benchmark on a lent GPU machine (Python 3.12, its own
# torch; Monarch and vLLM are not there). Two steps:
#   here:   bash tests/gpu/device.sh fetch     # wheels for Python 3.12 into .whl/ (git-ignored)
#   device: bash tests/gpu/device.sh run       # with .whl carried; writes $OUT/gpu-tests.log
set -euo pipefail
cd "$(dirname "$0")/../.."
# The device image has torch (2.11), pytest, pytest-timeout, psutil, nvidia-ml-py, tqdm,
# matplotlib. Of what tests/gpu and bench/memory.py import, only torch_memory_saver is missing
# (they use no Monarch, vLLM, pytest-asyncio or transformers).
WHEELS=(torch-memory-saver==0.0.10)
case "${1:-}" in
  fetch)
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    for wheel in "${WHEELS[@]}"; do
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d .whl "$wheel"
    done ;;
  run)
    python3 -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/site .whl/*.whl
    export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
    nvidia-smi -L
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu 2>&1 | tee "${OUT:-.}/gpu-tests.log"
    python3 bench/memory.py --device cuda --out "${OUT:-runs}/bench_memory_cuda" ;;
  *) echo "usage: $0 fetch|run" >&2; exit 2 ;;
esac
