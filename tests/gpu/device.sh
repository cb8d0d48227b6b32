#!/usr/bin/env bash
# Run the GPU tests and the GPU benchmarks on a lent GPU machine (Python 3.12, its own torch;
# Monarch and vLLM are not there). Two steps:
#   here:   bash tests/gpu/device.sh fetch     # wheels + Monarch for Python 3.12 into .whl/
#                                              # (git-ignored; carry: [".whl"])
#   device: bash tests/gpu/device.sh run       # with .whl carried, in one 10-minute call:
#           tests/gpu (the runtime through Monarch on the GPUs, the RL loop on one GPU, the
#           memory layer), then the RL loop at ~0.5 B parameters (its switch share on a GPU),
#           bench/memory.py --device cuda and the trainer -> generator handoff of 1.7 GB;
#           writes $OUT/summary.md (every test by outcome, each benchmark's table),
#           gpu-tests.log/.xml, bench-*.log, rl-loop-metrics.json
#   device: bash tests/gpu/device.sh bench     # longer benchmarks, in a call of their own:
#           the handoff of 1.7 GB with more rounds (bench/engines.py)
set -euo pipefail
cd "$(dirname "$0")/../.."
# The device image has torch (2.11), transformers (5.17), tensorboard, pytest,
# pytest-timeout, pyyaml, psutil, nvidia-ml-py, tqdm, matplotlib (its package list:
# ../.library/device/KINDS.md). The tests and benchmarks also import torch_memory_saver,
# OmegaConf (the RL loop's config), pytest-asyncio (the runtime's async tests) and Monarch;
# no vLLM. `fetch` downloads the first three with their dependencies and packs Monarch
# stripped and compressed (tests/gpu/bundle.py) with the few small packages `import
# monarch.actor` loads; `run` installs only the wheels whose distribution the image lacks,
# and unpacks Monarch.
WHEELS=(torch-memory-saver==0.0.10 omegaconf==2.4.0 pytest-asyncio==1.5.0)
MONARCH=torchmonarch==0.7.0
# what `import monarch.actor` loads beyond torch that the image lacks (it has cloudpickle,
# pyre-extensions, typing-inspect, mypy-extensions, tabulate and typing-extensions)
MONARCH_NEEDS=(opentelemetry-api wcwidth)
LIMIT_MIB=64  # the device tool's carry limit, for the whole working tree
# downloaded as dependencies but not carried: the image has them
ON_DEVICE=(numpy tqdm filelock fsspec typing_extensions packaging hf_xet pyyaml pytest pluggy
           iniconfig pygments)
case "${1:-}" in
  fetch)
    exclude=$(git rev-parse --git-path info/exclude)  # a worktree's .git is a file
    mkdir -p "$(dirname "$exclude")"
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
    rm -rf .whl  # what an earlier fetch left would travel too
    python3 -m pip download -q --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform any -d .whl "${WHEELS[@]}" \
      "${MONARCH_NEEDS[@]}"
    tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux2014_x86_64 -d "$tmp" "$MONARCH"
    for name in "${ON_DEVICE[@]}"; do rm -f .whl/"$name"-*.whl; done
    python3 tests/gpu/bundle.py build "$tmp"/torchmonarch-*.whl .whl/monarch-cp312.tar.xz
    rm -rf "$tmp"
    whl=$(du -sb .whl | cut -f1)
    tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 cat | wc -c)
    awk -v w="$whl" -v t="$tree" -v l="$LIMIT_MIB" 'BEGIN { printf "carried: .whl %.1f MiB + the working tree %.1f MiB = %.1f MiB (limit %d MiB)\n", w / 2^20, t / 2^20, (w + t) / 2^20, l }'
    if (( whl + tree > LIMIT_MIB << 20 )); then
      echo "over the carry limit: remove what .whl need not hold" >&2; exit 1
    fi ;;
  run|bench)
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
    python3 tests/gpu/bundle.py unpack .whl/monarch-cp312.tar.xz /tmp/site
    export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
    out="${OUT:-runs/gpu}"; mkdir -p "$out"
    nvidia-smi -L
    # every step runs whatever the one before did (a failed test must not hide a
    # benchmark); the limits keep each mode within one 10-minute device call
    status=0
    if [[ $1 == run ]]; then
      # the runtime's tests first (the memory layer's passed on an H100 and an H200); at
      # the limit, SIGINT: pytest still writes its XML and summary for what ran
      timeout -s INT -k 10 320 python3 -m pytest -v -p no:cacheprovider -m gpu \
        tests/gpu/test_runtime_cuda.py tests/gpu/test_rl_loop_cuda.py \
        $(ls tests/gpu/test_*.py | grep -v -e test_runtime_cuda -e test_rl_loop_cuda) \
        --durations=0 --junitxml="$out/gpu-tests.xml" 2>&1 | tee "$out/gpu-tests.log" \
        || status=1
      # the RL loop with a random Llama of ~0.5 B parameters (2 GB of fp32 weights), its
      # switch share on a GPU: metrics.json's summary and per-step switch_s / sync_s. The
      # init and lr of a model that size: the tiny model's (std 0.1, lr 1e-3) diverged
      # on an H200 (bench/RESULTS.md, "Second GPU session")
      rl=/tmp/rl_loop_cuda
      timeout 110 python3 -m examples.rl_loop run.steps=8 run.eval_every=8 run.save_every=0 \
        model.hidden_size=1536 model.layers=20 model.heads=12 model.kv_heads=2 \
        model.intermediate_size=4096 model.init_std=0.02 grpo.lr=1e-5 run.out="$rl" 2>&1 \
        | tee "$out/bench-rl-loop.log" \
        || status=1
      cp "$rl/metrics.json" "$out/rl-loop-metrics.json" 2>/dev/null || status=1
      timeout 45 python3 bench/memory.py --device cuda --out /tmp/bench_memory_cuda 2>&1 \
        | tee "$out/bench-memory.log" || status=1
      rounds=2 limit=60
    else
      rounds=5 limit=480
    fi
    # dim 1536 x 12 layers: about 425 M parameters, 1.7 GB of fp32 weights
    timeout "$limit" python3 bench/engines.py --engines torch --dim 1536 --layers 12 \
      --rounds "$rounds" --out /tmp/bench_engines_cuda/results.json 2>&1 \
      | tee "$out/bench-engines.log" || status=1
    python3 tests/gpu/summary.py "$out" "$1" | tee "$out/summary.md"
    exit "$status" ;;
  *) echo "usage: $0 fetch|run|bench" >&2; exit 2 ;;
esac
