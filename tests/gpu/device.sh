#!/usr/bin/env bash
# Run the GPU tests and the GPU benchmarks on a lent GPU machine (Python 3.12, its own torch;
# Monarch and vLLM are not there). Two steps:
#   here:   bash tests/gpu/device.sh fetch     # wheels + Monarch for Python 3.12 into .whl/
#                                              # (git-ignored; carry: [".whl"])
#   device: bash tests/gpu/device.sh run       # with .whl carried, in one 10-minute call
#           (GPU_RUN_BUDGET_S, 560 s by default, from the start to the summary), on an
#           H100 as on an H200, in this order, the cheap and decisive first:
#           1. the memory layer's and the engines' decisive GPU tests (pinning, pause and
#              resume, the planned sync, the handoff, refusals),
#           2. bench/memory.py --device cuda (each size's row printed as it finishes),
#           3. bench/engines.py: the trainer -> generator handoff of 1.7 GB,
#           4. the RL loop at ~0.5 B parameters (its switch share on a GPU),
#           5. the runtime through Monarch and the arbiter's tests, 6. the rest of the
#              memory layer's, 7. the RL loop's test (train, save, export, resume);
#           each part under a time limit of its own, and started only when the time it
#           took on an H100 is left: a part skipped for lack of time is named in
#           $OUT/budget.log and the summary. Writes $OUT/summary.md (the GPU, every test by
#           outcome, each part's time, each benchmark's table), gpu-tests-*.xml/.log,
#           bench-*.log, rl-loop-metrics.json
#   device: bash tests/gpu/device.sh bench     # longer benchmarks, in a call of their own:
#           what pin_memory() costs against the memory layer's own pinned buffers
#           (bench/pinned.py), the tool task's episodes with the torch generator
#           (bench/agentic.py), the handoff of 1.7 GB with more rounds (bench/engines.py)
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
    budget_end=$(( SECONDS + ${GPU_RUN_BUDGET_S:-560} ))  # the clock runs from here
    SUMMARY_S=15  # kept for the summary (and a part's 10 s between SIGINT and SIGKILL)
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
    nvidia-smi -L | tee "$out/gpu.txt"
    : > "$out/budget.log"
    # every part runs whatever the one before did (a failed test must not hide a benchmark)
    status=0
    # part NAME NEED LIMIT LOG CMD...: CMD (its output into $out/LOG too) if NEED seconds
    # (what it took on an H100) are left of the budget, less the summary's; for at most
    # LIMIT seconds, or what is left. At the limit, SIGINT (pytest still writes its XML, a
    # benchmark keeps the rows it printed), then SIGKILL 10 s later.
    part() {
      local name=$1 need=$2 limit=$3 log=$4; shift 4
      local left=$(( budget_end - SUMMARY_S - SECONDS ))
      if (( left < need )); then
        echo "budget: skipped $name: it took ~$need s on an H100, $left s were left" \
          | tee -a "$out/budget.log"
        status=1
        return 0
      fi
      local cap=$(( limit < left ? limit : left )) began=$SECONDS rc=0
      timeout -s INT -k 10 "$cap" "$@" 2>&1 | tee -a "$out/$log" || rc=$?
      local verdict="done"
      if (( rc == 124 || rc == 137 )); then verdict="stopped at its limit"
      elif (( rc != 0 )); then verdict="failed"; fi
      echo "budget: $name: $(( SECONDS - began )) s of $cap (limit $limit, H100 ~$need), rc $rc, $verdict" \
        | tee -a "$out/budget.log"
      if (( rc != 0 )); then status=1; fi
    }
    if [[ $1 == run ]]; then
      # the tests that decide whether the memory layer and the engines work on this GPU
      decisive="pinned_as_it_gets or planned_in_place or pause_releases or"
      decisive+=" take_turns_with_weight_sync or resume_without_room or bad_transitions"
      pytest=(python3 -m pytest -v -p no:cacheprovider -m gpu --durations=0)
      # H100: ~10 s a memory test (a fresh process each), ~35 s a handoff test
      part "tests: memory and engines, decisive" 120 180 gpu-tests-1.log \
        "${pytest[@]}" tests/gpu/test_memory_cuda.py tests/gpu/test_engines_cuda.py \
        -k "$decisive" --junitxml="$out/gpu-tests-1.xml"
      # a fresh process per row, ~15 s each on an H100 (3 rows in 45 s); a row of the
      # bytes as 256 KiB tensors beside each size's row
      part "bench/memory.py" 45 60 bench-memory.log \
        python3 -m bench.memory --device cuda --sizes 256,1024 --tensor-kib 0,256 \
        --out /tmp/bench_memory_cuda
      # dim 1536 x 12 layers: about 425 M parameters, 1.7 GB of fp32 weights
      part "bench/engines.py" 45 70 bench-engines.log \
        python3 -m bench.engines --engines torch --dim 1536 --layers 12 --rounds 2 \
        --out /tmp/bench_engines_cuda/results.json
      # the RL loop with a random Llama of ~0.5 B parameters (2 GB of fp32 weights), its
      # switch share on a GPU: metrics.json's summary and per-step switch_s / sync_s. The
      # init and lr of a model that size: the tiny model's (std 0.1, lr 1e-3) diverged
      # on an H200 (bench/RESULTS.md, "Second GPU session")
      rl=/tmp/rl_loop_cuda
      big=(run.steps=8 run.eval_every=8 run.save_every=0 model.hidden_size=1536
           model.layers=20 model.heads=12 model.kv_heads=2 model.intermediate_size=4096
           model.init_std=0.02 grpo.lr=1e-5)
      # the budget policy with the GPU's own memory (ample: nothing need move), then
      # capped to the trainer alone (tests/gpu/slot_cap.py): bytes moved against required
      part "RL loop, ~0.5 B" 80 110 bench-rl-loop.log \
        python3 -m examples.rl_loop "${big[@]}" run.out="$rl"
      cp "$rl/metrics.json" "$out/rl-loop-metrics.json" 2>/dev/null || status=1
      # the GPU's rates (calibrated by the run's plan): plans for this GPU made elsewhere
      cp "$HOME"/.cache/colocate/rates-*.json "$out/" 2>/dev/null || true
      if cap=$(python3 tests/gpu/slot_cap.py "$rl/metrics.json" "${big[@]}" run.out="$rl"); then
        part "RL loop, ~0.5 B, slot capped at $cap B" 80 110 bench-rl-loop-capped.log \
          python3 -m examples.rl_loop "${big[@]}" run.out="$rl-capped" run.slot_memory="$cap"
        cp "$rl-capped/metrics.json" "$out/rl-loop-capped-metrics.json" 2>/dev/null || status=1
      fi
      # H100: the runtime 37.6 s, the arbiter's 49.6 / 48.6 s (before it compared on the
      # device); FSDP and the hybrid engine skip on one GPU without vLLM
      part "tests: the runtime and the arbiter" 100 150 gpu-tests-2.log \
        "${pytest[@]}" tests/gpu/test_runtime_cuda.py tests/gpu/test_arbiter_cuda.py \
        tests/gpu/test_fsdp_cuda.py tests/gpu/test_hybrid_cuda.py \
        --junitxml="$out/gpu-tests-2.xml"
      # a thousand cycles, the cuBLAS workspace and the exit status in both hook modes,
      # slot procs by UUID: ~10 s each on an H100
      part "tests: the rest of the memory layer" 70 110 gpu-tests-3.log \
        "${pytest[@]}" tests/gpu/test_memory_cuda.py -k "not ($decisive)" \
        --junitxml="$out/gpu-tests-3.xml"
      # H100: 120.5 s (two runs of the loop through Monarch)
      part "tests: the RL loop (train, save, export, resume)" 120 170 gpu-tests-4.log \
        "${pytest[@]}" tests/gpu/test_rl_loop_cuda.py --junitxml="$out/gpu-tests-4.xml"
    else
      # what pin_memory() costs (rounded up to a power of two) against the memory layer's
      # own pinned buffers (the bytes asked); not yet run on a GPU
      part "bench/pinned.py" 20 60 bench-pinned.log \
        python3 -m bench.pinned --sizes-mib 256,1024,2304 --out "$out/bench-pinned.json"
      # the tool task trained, then its episodes at once against one at a time, in cohorts
      # and continuous, with the torch generator (one replica on the one GPU: no prefix
      # shares; no vLLM here); not yet run on a GPU (3.6 min on 2 CPU cores, vLLM's arms
      # included)
      part "bench/agentic.py" 120 240 bench-agentic.log \
        python3 -m bench.agentic --replicas 1 --engines torch --out "$out/bench-agentic.json"
      part "bench/engines.py, 5 rounds" 60 480 bench-engines.log \
        python3 -m bench.engines --engines torch --dim 1536 --layers 12 --rounds 5 \
        --out /tmp/bench_engines_cuda/results.json
    fi
    python3 tests/gpu/summary.py "$out" "$1" | tee "$out/summary.md"
    exit "$status" ;;
  *) echo "usage: $0 fetch|run|bench" >&2; exit 2 ;;
esac
