"""Engines side by side in one process: generation speed, sleep/wake cost, weight sync.

1. Tokens/s of the built-in torch generator and of vLLM (CPU build) on the same model and
   prompts: `--prompts` prompts, `--new-tokens` greedy tokens each (stop tokens off, so both
   generate the same number), median of `--rounds` rounds after one warm-up.
2. Sleep and wake seconds per GiB of each engine (weights with backup + KV cache without),
   median of `--rounds` cycles.
3. Weight sync trainer -> torch generator, in GB/s, against a raw memcpy of the same tensors
   into plain preallocated ones, measured alternately (target: sync >= 0.7x raw):
   `in place` (what a handoff's copy does: `copy_weights` into the generator's own tensors,
   its copy planned once), `in place, per tensor` (the copy as it was before the plan, in
   the same run: the model walked and checked at every sync, one `copy_` per tensor),
   `shared memory` (export to /dev/shm, then load: two copies; what replicas on other procs
   use), and `handoff` (the arbiter's whole staged handoff: stage sleeps, wakes and the copy).
   On a GPU (the engines place the models there) these are device copies, each timing
   bracketed by `torch.cuda.synchronize()` (before, a timing could end with its copies
   still queued): `device.sh bench` runs it with 1.7 GB of weights.

    python -m bench.engines [--dim 512] [--layers 8] [--engines torch,vllm] [--rounds 5]
                            [--out runs/bench_engines/results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from bench.common import announce
from colocate.arbiter import SlotArbiter
from colocate.arbiter.local import LocalTenantHandle
from colocate.engines.generator import TorchGenerator
from colocate.engines.models import load_model, load_tokenizer
from colocate.engines.sampling import SamplingParams
from colocate.engines.tiny import write_tiny_model
from colocate.engines.trainer import PolicyTrainer
from colocate.engines.weight_copy import check_weights, copy_weights
from colocate.engines.weights import (
    as_stream,
    export_weights,
    read_exported,
)

MIN_SYNC_RATIO = 0.7
GiB = 1 << 30


def _drain() -> None:
    """Wait for the device's queued work, so a timing holds the copies it launched."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def median_s(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        _drain()
        start = time.perf_counter()
        fn()
        _drain()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def per_tensor_copy(model: torch.nn.Module, weights) -> int:
    """The in-place copy as `copy_weights` made it before its plan: the model walked and
    every name and shape checked at each sync, then one `copy_` per tensor."""
    stream = as_stream(weights)
    own = model.state_dict()
    check_weights({n: tuple(t.shape) for n, t in own.items()},
                  {n: shape for n, (shape, _) in stream.specs.items()}, "the model")
    copied = 0
    with torch.no_grad():
        for name, tensor in stream.tensors():
            own[name].copy_(tensor)
            copied += tensor.numel() * tensor.element_size()
    return copied


def make_engine(kind: str, model_dir: str, max_batch: int):
    if kind == "torch":
        return TorchGenerator(load_model(model_dir), max_batch, prefix="bench_torch")
    from colocate.engines.vllm_generator import VLLMGenerator

    return VLLMGenerator(model_dir, max_batch=max_batch)


def engine_rows(kind: str, model_dir: str, prompts: list[list[int]], params: SamplingParams,
                rounds: int) -> dict:
    start = time.perf_counter()
    engine = make_engine(kind, model_dir, len(prompts))
    init_s = time.perf_counter() - start
    engine.generate(prompts, params)  # warm-up
    gen_s = median_s(lambda: engine.generate(prompts, params), rounds)
    tokens = len(prompts) * params.max_new_tokens
    stages = list(engine.tenancy.describe().stages)
    held = engine.tenancy.describe().tagged_bytes
    sleeps, wakes = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        engine.tenancy.sleep()
        sleeps.append(time.perf_counter() - start)
        start = time.perf_counter()
        engine.tenancy.wake(stages)
        wakes.append(time.perf_counter() - start)
    return {"engine": kind, "init_s": init_s, "tokens_per_s": tokens / gen_s,
            "bytes": held, "sleep_s_per_gib": statistics.median(sleeps) / (held / GiB),
            "wake_s_per_gib": statistics.median(wakes) / (held / GiB)}


def sync_rows(model_dir: str, rounds: int) -> dict:
    trainer = PolicyTrainer(load_model(model_dir), prefix="bench_trainer")
    gen = TorchGenerator(load_model(model_dir), max_batch=4, prefix="bench_gen")
    sources = [t for _, t in trainer.weights().tensors()]
    plain = [torch.empty_like(t) for t in sources]
    nbytes = sum(t.numel() * t.element_size() for t in sources)

    def raw() -> None:
        for dst, src in zip(plain, sources, strict=True):
            dst.copy_(src)

    ways = {"raw": raw,
            "in place": lambda: copy_weights(gen.model, trainer.weights()),
            "in place, per tensor": lambda: per_tensor_copy(gen.model, trainer.weights()),
            "shared memory": lambda: read_exported(
                export_weights(trainer.weights().tensors(), "bench_engines"),
                lambda views: copy_weights(gen.model, views))}
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in tqdm(range(rounds), desc="weight sync", leave=False):
        for way, fn in ways.items():  # alternated: both see the same machine state
            times[way].append(median_s(fn, 1))
    times["handoff"] = asyncio.run(handoff_times(trainer, gen, rounds))
    raw_s = statistics.median(times["raw"])
    return {"bytes": nbytes, **{way: {"gb_per_s": nbytes / statistics.median(t) / 1e9,
                                      "ratio": raw_s / statistics.median(t)}
                                for way, t in times.items()}}


async def handoff_times(trainer: PolicyTrainer, gen: TorchGenerator, rounds: int) -> list[float]:
    arbiter = SlotArbiter([0])
    await arbiter.register(0, LocalTenantHandle("bench_trainer", trainer.tenancy))
    await arbiter.register(0, LocalTenantHandle("bench_gen", gen.tenancy, gen.receive))
    times = []
    for _ in range(rounds):
        await arbiter.wake("bench_trainer")
        start = time.perf_counter()
        await arbiter.handoff("bench_trainer", "bench_gen")
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--engines", default="torch,vllm")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="runs/bench_engines/results.json")
    args = parser.parse_args()
    machine, command = announce()
    if torch.cuda.is_available():  # which kind of GPU each figure came from
        machine["device"] = torch.cuda.get_device_name(0)
        print(f"device: {machine['device']}")
    model_dir = str(write_tiny_model(
        Path(tempfile.mkdtemp()) / "model", "llama", alphabet="0123456789+=>",
        hidden_size=args.dim, layers=args.layers, heads=args.dim // 64,
        kv_heads=args.dim // 128 or 1, intermediate_size=4 * args.dim, max_positions=64))
    tokenizer = load_tokenizer(model_dir)
    prompts = [tokenizer(f"{i * 37 % 1000}+{i * 91 % 1000}=").input_ids
               for i in range(args.prompts)]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0)
    engines = [engine_rows(kind, model_dir, prompts, params, args.rounds)
               for kind in tqdm(args.engines.split(","), desc="engines")]
    sync = sync_rows(model_dir, args.rounds)
    params_m = sum(p.numel() for p in load_model(model_dir).parameters()) / 1e6
    print(f"\nmodel: dim {args.dim}, {args.layers} layers, {params_m:.1f} M parameters; "
          f"{args.prompts} prompts x {args.new_tokens} greedy tokens")
    print("| engine | init s | tokens/s | MiB held | sleep s/GiB | wake s/GiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in engines:
        print(f"| {row['engine']} | {row['init_s']:.1f} | {row['tokens_per_s']:.0f} | "
              f"{row['bytes'] / 2**20:.0f} | {row['sleep_s_per_gib']:.3f} | "
              f"{row['wake_s_per_gib']:.3f} |")
    print(f"\nweight sync of {sync['bytes'] / 2**20:.0f} MiB, against raw memcpy "
          f"({sync['raw']['gb_per_s']:.2f} GB/s):")
    print("| way | GB/s | s/GB | / raw | target | verdict |")
    print("|---|---:|---:|---:|---:|---|")
    for way in ("in place", "in place, per tensor", "shared memory", "handoff"):
        row = sync[way]
        target = f">= {MIN_SYNC_RATIO}" if way.startswith("in place") else ""
        verdict = ("PASS" if row["ratio"] >= MIN_SYNC_RATIO else "FAIL") if target else ""
        print(f"| {way} | {row['gb_per_s']:.2f} | {1 / row['gb_per_s']:.3f} | "
              f"{row['ratio']:.2f} | {target} | {verdict} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "command": command, "engines": engines,
                               "sync": sync}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
