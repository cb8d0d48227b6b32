"""The hybrid engine on 2 slots: vLLM on the trainer's own procs, synced in place, and one RL
step colocated vs split.

A 2-proc trainer (DDP and FSDP for the sync, `--parallel`; DDP for the RL step,
`--step-parallel`) and one vLLM replica over the same
2 procs (`generator.tensor_parallel_size` ranks per copy, 2 / that data-parallel copies,
`external_launcher`), CPU procs standing in for GPUs, a model of tens of MiB (the defaults
below: dim 512, 8 layers, 8 heads, 20 M parameters, 80 MiB in fp32).

1. Weight sync, per proc. `sync_weights(trainer, generator)` runs as the RL loop runs it (a
   staged handoff through the arbiters: the trainer keeps only its weights, vLLM wakes its
   weights, `receive` loads them with vLLM's `load_weights` a bucket of `--bucket-mb` at a
   time, the trainer sleeps, vLLM wakes its KV cache). A `SyncProbe` actor on each proc
   wraps `VLLMGenerator.load_weights` in that proc (the class's method) and times it
   there: bytes given to vLLM on this proc (the full tensors; with TP each rank keeps its
   shard of them) / seconds = sync GB/s per proc. Raw: in the same proc, between the
   syncs, a memcpy (`copy_`) of the same tensors the sync reads (the trainer's published
   weights; from FSDP, gathered once) into preallocated tensors of their shapes, median of
   3 copies after one untimed copy; that first copy into the new tensors (page faults
   included) is shown too. `--rounds` syncs and memcpys alternate; medians. The whole
   `sync_weights` call timed in the client (staging switches included) is shown too.
2. Peak extra memory of a sync, per proc, over the bucket size. Primary (exact, not
   sampled): the wrapper resets the proc's peak RSS (`echo 5 > /proc/self/clear_refs`)
   as the load starts and reads VmHWM when it ends; extra = VmHWM - VmRSS at the start.
   Check: anonymous RSS sampled every 1 ms from this process during the syncs (bench/
   rl_step.py's `Sampler`), max within the load's window minus the last sample before it.
   Both weight sets are resident throughout the load (the staged handoff's planned 2W),
   so "extra" is what the sync allocates beyond them: gathered buckets, loader
   temporaries. The bound it is held to: one bucket + the largest tensor. Max over rounds. The
   procs run with a fixed glibc mmap threshold (`MALLOC_MMAP_THRESHOLD_`), so freed
   buffers leave RSS and the peak is not glibc's retention.
3. One RL step's time split (generate, train, switch, sync) colocated (`run.colocate=true`:
   trainer and vLLM on the same 2 procs) vs split (`false`: 2 procs each), engine vllm,
   2 slots: bench/rl_step.py's `run_mode`, means over `--steps` after `--warmup`, the
   trainer's syncs in buckets of `--bucket-mb` too.
4. Colocated peak memory / split peak, as bench/rl_step.py defines it (sum over procs of
   each proc's peak; (a) tagged bytes from the switch timeline, (b) anonymous RSS above a
   fresh proc's baseline, sampled every `--interval-ms`).

Prints the tables and a last summary line; writes `--out` (JSON).

    HF_HUB_DISABLE_PROGRESS_BARS=1 VLLM_LOGGING_LEVEL=WARNING python -m bench.hybrid
        [--steps 3] [--warmup 1] [--rounds 8] [--bucket-mb 8] [--parallel ddp,fsdp]
        [--step-parallel ddp] [--interval-ms 5] [--out runs/bench_hybrid/results.json]
        [section.field=value ...]

The overrides go to the RL loop's config, after this bench's defaults (DEFAULTS below);
this bench sets run.colocate, run.out, run.steps, run.eval_every and trainer.parallel.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from monarch.actor import Actor, endpoint
from tqdm import tqdm

from bench import rl_step
from bench.common import announce
from bench.engines import median_s

MIB = 1 << 20
DEFAULTS = ["run.engine=vllm", "run.slots=2", "model.hidden_size=512", "model.layers=8",
            "model.heads=8", "model.kv_heads=8", "model.intermediate_size=1024",
            "model.max_positions=64"]
MEMCPY_REPEATS = 3


def _status() -> dict[str, int]:
    """This process's VmRSS, VmHWM and RssAnon, in bytes."""
    found = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon"):
                found[key] = int(value.split()[0]) * 1024
    return found


class SyncProbe(Actor):
    """On a proc with a trainer and a vLLM rank: times and measures that proc's part of each
    sync (`instrument`), and a raw memcpy of the same tensors (`memcpy`)."""

    def __init__(self) -> None:
        self.loads: list[dict[str, Any]] = []

    @endpoint
    def instrument(self) -> int:
        """Wrap `VLLMGenerator.load_weights` in this proc (the class's: vLLM freezes the
        GC heap, so its instance is out of `gc`'s reach; the handoff's `receive` calls it)
        with a timer and a peak-RSS reading; returns the pid."""
        from colocate.engines.vllm_generator import VLLMGenerator

        load = VLLMGenerator.load_weights

        def timed(engine: VLLMGenerator, weights: Any) -> int:
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")  # VmHWM := VmRSS
            before, at = _status(), time.time()
            start = time.perf_counter()
            nbytes = load(engine, weights)
            seconds = time.perf_counter() - start
            after = _status()
            self.loads.append({"start": at, "end": at + seconds, "seconds": seconds,
                               "bytes": nbytes, "rss_before": before["VmRSS"],
                               "hwm": after["VmHWM"], "anon_before": before["RssAnon"],
                               "anon_after": after["RssAnon"]})
            return nbytes

        VLLMGenerator.load_weights = timed
        return os.getpid()

    @endpoint
    def taken(self) -> list[dict[str, Any]]:
        """The loads timed since the last call."""
        loads, self.loads = self.loads, []
        return loads

    @endpoint
    def memcpy(self, source: str) -> dict[str, Any]:
        """Median seconds of a memcpy of tenant `source`'s published weights (from FSDP:
        gathered first, untimed; call it on every rank) into preallocated tensors."""
        from colocate.engines.weights import published

        stream = published(source)
        tensors = [t for _, t in stream.tensors()]
        plain = [torch.empty_like(t) for t in tensors]

        def copy() -> None:
            for dst, src in zip(plain, tensors, strict=True):
                dst.copy_(src)

        start = time.perf_counter()
        copy()  # faults the destination's pages in, as vLLM's tensors are when it loads
        first = time.perf_counter() - start
        return {"seconds": median_s(copy, MEMCPY_REPEATS), "first_seconds": first,
                "bytes": sum(t.numel() * t.element_size() for t in tensors),
                "largest": max(t.numel() * t.element_size() for t in tensors)}


MALLOC_ENV = "MALLOC_MMAP_THRESHOLD_"


async def sync_part(parallel: str, args: argparse.Namespace) -> dict[str, Any]:
    """Parts 1 and 2 for one trainer parallelism: `--rounds` syncs, each after a memcpy."""
    from colocate import init, phase
    from colocate.engines.actors import GeneratorActor, TrainerActor
    from examples.rl_loop.config import load_config
    from examples.rl_loop.runtime import model_dir
    from services import ServiceConfig, spawn_service, sync_weights

    cfg = load_config(overrides=[*DEFAULTS, *args.overrides, f"trainer.parallel={parallel}",
                                 f"trainer.bucket_mb={args.bucket_mb}"])
    out = args.out.parent / parallel / "sync"
    directory = str(model_dir(cfg, out))
    tp = cfg.generator.tensor_parallel_size
    slots = cfg.run.slots
    # The procs get a fixed glibc mmap threshold (mallopt(3): it turns off the dynamic
    # one). Otherwise glibc keeps freed large buffers in its heap, or not, as earlier
    # frees moved the threshold, and the same sync read anything from 0 to 3.4 buckets
    # of VmHWM. With it, each buffer over 64 KiB is mapped and unmapped, so the peak is
    # what the sync holds at once. Procs take the environment as they are spawned.
    os.environ[MALLOC_ENV] = str(64 * 1024)
    rm = await init("local", gpus_per_host=slots)
    try:
        bar = tqdm(total=args.rounds + 1, desc=f"sync {parallel}", unit="sync")
        trainer = await spawn_service(
            ServiceConfig(procs_per_host=slots, resource_group="rl", respawn=False),
            TrainerActor, directory, name="trainer", **vars(cfg.trainer))
        generator = await spawn_service(
            ServiceConfig(procs_per_host=slots, resource_group="rl"), GeneratorActor,
            directory, name="generator", engine="vllm", tensor_parallel_size=tp,
            data_parallel_size=slots // tp)
        source = trainer.replicas[0].tenant
        probe = rm.group("rl").procs.spawn("bench_sync_probe", SyncProbe)
        pids = [pid for _, pid in (await probe.instrument.call()).items()]
        await sync_weights(trainer, generator)  # warm-up: vLLM's first check of names
        await probe.taken.call()
        bar.update()
        sampler = rl_step.Sampler(pids, 1e-3)
        sampler.start()
        memcpys, wholes = [], []
        for _ in range(args.rounds):
            async with phase(trainer):  # the handoff starts from an awake trainer
                memcpys.append([v for _, v in (await probe.memcpy.call(source)).items()])
            start = time.perf_counter()
            report = await sync_weights(trainer, generator)
            wholes.append({"seconds": time.perf_counter() - start,
                           "bytes": report.total_bytes})
            bar.update()
        sampler.stop()
        bar.close()
        loads = [v for _, v in (await probe.taken.call()).items()]
    finally:
        await rm.shutdown()
        del os.environ[MALLOC_ENV]
    procs = []
    for index, (pid, timed) in enumerate(zip(pids, loads, strict=True)):
        copies = [round_[index] for round_ in memcpys]
        for load in timed:  # the anonymous RSS samples inside the load's window
            inside = [s[pid]["anon"] for at, s in sampler.samples
                      if load["start"] <= at <= load["end"]]
            prior = [s[pid]["anon"] for at, s in sampler.samples if at < load["start"]]
            load["sampled_extra"] = max(inside) - prior[-1] if inside and prior else None
            load["samples"] = len(inside)
        load_s = statistics.median(x["seconds"] for x in timed)
        copy_s = statistics.median(c["seconds"] for c in copies)
        nbytes = timed[0]["bytes"]
        sampled = [x["sampled_extra"] for x in timed if x["sampled_extra"] is not None]
        procs.append({
            "pid": pid, "bytes": nbytes, "load_s": load_s, "memcpy_s": copy_s,
            "memcpy_bytes": copies[0]["bytes"], "largest": copies[0]["largest"],
            "sync_gbps": nbytes / load_s / 1e9,
            "memcpy_gbps": copies[0]["bytes"] / copy_s / 1e9,
            "memcpy_first_gbps": copies[0]["bytes"]
            / statistics.median(c["first_seconds"] for c in copies) / 1e9,
            "peak_extra": max(x["hwm"] - x["rss_before"] for x in timed),
            "peak_extra_sampled": max(sampled) if sampled else None,
            "samples_per_load": statistics.median(x["samples"] for x in timed),
            "loads": timed, "memcpys": copies})
    whole_s = statistics.median(w["seconds"] for w in wholes)
    return {"parallel": parallel, "tp": tp, "dp": slots // tp, "bucket_mb": args.bucket_mb,
            "procs": procs, "whole_s": whole_s, "whole_bytes": wholes[0]["bytes"],
            "wholes": wholes}


def sync_tables(syncs: list[dict[str, Any]]) -> tuple[list[list[str]], list[list[str]]]:
    speed, peak = [], []
    for sync in syncs:
        label = f"{sync['parallel']}, vLLM tp={sync['tp']} dp={sync['dp']}"
        for index, proc in enumerate(sync["procs"]):
            speed.append([
                label, str(index), f"{proc['bytes'] / MIB:.1f}", f"{proc['load_s'] * 1e3:.1f}",
                f"{proc['sync_gbps']:.2f}", f"{proc['memcpy_gbps']:.2f}",
                f"{proc['sync_gbps'] / proc['memcpy_gbps']:.3f}",
                f"{proc['memcpy_first_gbps']:.2f}",
                f"{sync['whole_s'] * 1e3:.1f}",
                f"{sync['whole_bytes'] / len(sync['procs']) / sync['whole_s'] / 1e9:.2f}"])
            bucket = sync["bucket_mb"] * MIB
            bound = bucket + proc["largest"]
            sampled = proc["peak_extra_sampled"]
            peak.append([
                label, str(index), f"{sync['bucket_mb']}", f"{proc['largest'] / MIB:.2f}",
                f"{proc['peak_extra'] / MIB:.2f}", f"{proc['peak_extra'] / bucket:.3f}",
                "n/a" if sampled is None else f"{sampled / MIB:.2f}",
                "n/a" if sampled is None else f"{sampled / bucket:.3f}",
                f"{proc['samples_per_load']:.0f}",
                f"<= {bound / MIB:.2f}", "PASS" if proc["peak_extra"] <= bound else "FAIL"])
    return speed, peak


def step_table(coloc: dict[str, Any], split: dict[str, Any]) -> list[list[str]]:
    rows = []
    for key in ("generate_s", "train_s", "switch_s", "sync_s", "score_s", "step_s"):
        c, s = coloc[f"mean_{key}"], split[f"mean_{key}"]
        rows.append([f"mean {key}", f"{c:.4f}", f"{s:.4f}",
                     f"{c / s:.3f}" if s > 0 else "n/a"])
    rows.append(["switch share (switch_s + sync_s) / step_s", f"{coloc['switch_share']:.3f}",
                 f"{split['switch_share']:.3f}", ""])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="measured RL steps per mode")
    parser.add_argument("--warmup", type=int, default=1, help="RL steps not counted")
    parser.add_argument("--rounds", type=int, default=8, help="syncs measured (part 1, 2)")
    parser.add_argument("--bucket-mb", type=int, default=8, help="the trainer's bucket_mb")
    parser.add_argument("--parallel", default="ddp,fsdp",
                        help="trainer.parallel values of the sync measurements (1, 2)")
    parser.add_argument("--step-parallel", default="ddp",
                        help="trainer.parallel values of the RL step (3, 4), e.g. ddp,fsdp; "
                        "'' skips parts 3 and 4")
    parser.add_argument("--interval-ms", type=float, default=5.0,
                        help="memory sampling of the RL steps (part 4)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_hybrid/results.json"))
    parser.add_argument("overrides", nargs="*", help="section.field=value for the loop's config")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 1 or args.rounds < 1:
        parser.error("--steps, --warmup and --rounds must be >= 1")
    parallels = [p for p in args.parallel.split(",") if p]
    step_parallels = [p for p in args.step_parallel.split(",") if p]
    info, command = announce()
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    started = time.monotonic()
    # the parts, one tick each (a part's own bar starts once its procs are up)
    overall = tqdm(total=len(parallels) + 2 * len(step_parallels) + bool(step_parallels),
                   desc="bench hybrid", unit="part")
    syncs = []
    for parallel in parallels:
        overall.set_postfix_str(f"sync, {parallel}")
        syncs.append(asyncio.run(sync_part(parallel, args)))
        overall.update()
    steps: dict[str, dict[str, Any]] = {}
    for parallel in step_parallels:
        mode_args = argparse.Namespace(
            steps=args.steps, warmup=args.warmup, interval_ms=args.interval_ms,
            idle_gap_ms=rl_step.IDLE_GAP_MS, out=args.out.parent / parallel / "results.json",
            overrides=[*DEFAULTS, *args.overrides, f"trainer.parallel={parallel}",
                       f"trainer.bucket_mb={args.bucket_mb}"])
        steps[parallel] = {}
        for name in rl_step.MODES:
            overall.set_postfix_str(f"RL step, {parallel}, {name}")
            steps[parallel][name] = asyncio.run(rl_step.run_mode(name, mode_args))
            overall.update()
    if steps:
        overall.set_postfix_str("baselines")
        asyncio.run(rl_step.baselines([proc for modes in steps.values()
                                       for mode in modes.values() for proc in mode["procs"]]))
        overall.update()
    overall.close()
    results: dict[str, Any] = {}
    for parallel, modes in steps.items():
        for mode in tqdm(modes.values(), desc=f"peaks {parallel}", unit="mode"):
            rl_step.peaks(mode)
            for proc in mode["procs"]:
                del proc["modules"]  # thousands of names each; the baselines have used them
        memory_rows, _, verdicts = rl_step.tables(modes["colocated"], modes["split"])
        results[parallel] = {"memory_table": memory_rows, "verdicts": verdicts,
                             "time_table": step_table(modes["colocated"], modes["split"])}

    speed, peak = sync_tables(syncs)
    print(f"\nmodel and loop: {' '.join([*DEFAULTS, *args.overrides])}; "
          f"{args.rounds} syncs, bucket_mb={args.bucket_mb}")
    print("\n1. weight sync to the vLLM replica on the trainer's procs, per proc (load "
          "timed in the proc) vs memcpy of the same tensors in the same proc")
    rl_step.print_table(["trainer, generator", "proc", "MiB per proc", "load ms",
                         "sync GB/s", "memcpy GB/s", "sync / memcpy",
                         "memcpy into new tensors GB/s", "whole sync_weights ms",
                         "whole GB/s per proc"], speed)
    print("\n2. peak extra memory of a sync per proc (VmHWM reset at the load's start, "
          "minus VmRSS then; sampled: anonymous RSS every 1 ms), max over the syncs")
    rl_step.print_table(["trainer, generator", "proc", "bucket MiB", "largest tensor MiB",
                         "peak extra MiB", "/ bucket", "sampled anon extra MiB", "/ bucket",
                         "samples per load", "bound: bucket + largest", "verdict"], peak)
    for parallel, result in results.items():
        print(f"\n3. one RL step, trainer.parallel={parallel}, vLLM, 2 slots: means over "
              f"{args.steps} steps after {args.warmup} warm-up, seconds")
        rl_step.print_table(["time, s", "colocated", "split", "colocated / split"],
                            result["time_table"])
        print(f"\n4. peak memory, trainer.parallel={parallel} (sum over procs of each "
              f"proc's peak; anon sampled every {args.interval_ms:g} ms)")
        rl_step.print_table(["memory, MiB (sum of per-proc peaks)", "colocated",
                             "split trainer", "split generator", "colocated / split",
                             "target", "verdict"], result["memory_table"])
    elapsed = time.monotonic() - started
    print(f"took {elapsed:.0f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": info, "command": command, "defaults": DEFAULTS, "overrides": args.overrides,
        "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
        "bucket_mb": args.bucket_mb, "interval_ms": args.interval_ms, "seconds": elapsed,
        "sync": syncs, "sync_table": speed, "peak_table": peak, "rl": results,
        "modes": steps}, indent=1, default=str))
    print(f"results: {args.out}")
    parts = []
    for sync in syncs:
        procs = sync["procs"]
        parts.append(
            f"{sync['parallel']} sync/memcpy "
            f"{min(p['sync_gbps'] / p['memcpy_gbps'] for p in procs):.2f}-"
            f"{max(p['sync_gbps'] / p['memcpy_gbps'] for p in procs):.2f} "
            f"({min(p['sync_gbps'] for p in procs):.2f}-"
            f"{max(p['sync_gbps'] for p in procs):.2f} GB/s per proc), sync peak extra/bucket "
            f"{max(p['peak_extra'] for p in procs) / (sync['bucket_mb'] * MIB):.2f}")
    for parallel, result in results.items():
        coloc, split = steps[parallel]["colocated"], steps[parallel]["split"]
        parts.append(
            f"{parallel} step colocated/split {coloc['mean_step_s'] / split['mean_step_s']:.2f}"
            f" (switch+sync share {coloc['switch_share']:.2f}), peak memory colocated/split "
            f"tagged {result['verdicts']['ratio_peak_tagged']:.2f} anon "
            f"{result['verdicts']['ratio_peak_anon']:.2f}")
    print("summary: " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    # Run as the module `bench.hybrid`, so the actor class has a name the procs can import.
    from bench.hybrid import main as module_main

    sys.exit(module_main())
