"""FSDP weight sync: the per-tensor gather against `fsdp_gather.BucketGather`, paired in one
run, to check that one collective per sync bucket is worth its code (target: >= 3x the
per-tensor way).

Two gloo procs (CPU), a Qwen2-shaped model sharded by FSDP2 as the trainer shards it
(`parallel.shard`), its state dict cut into buckets as `PolicyTrainer.weights` cuts it
(`--bucket-mb`). One pass = every bucket gathered into full tensors and let go, as a sync
streams them. Two ways, alternated within each of `--rounds` rounds (the first one to run
alternates too), after one warm-up pass each:

- per tensor: the baseline (below, `per_tensor_gather`): one buffer per bucket, and on
  gloo each rank broadcasts its chunk of each tensor in place, so `world` broadcasts per
  tensor.
- per bucket: a pass through one `BucketGather`, as `PolicyTrainer.weights` gathers: each
  rank writes its rows into a shared-memory buffer all ranks map, one all-reduce of a flag
  says all are in, and one more before the next bucket reuses the buffer.

The floor, timed in the same rounds: the least a per-bucket gather must do when it keeps no
memory between passes (colocation's point: a sleeping trainer holds none): make one
shared buffer the size of the pass's largest bucket (the gather's own `_SharedBuffer`:
the kernel zeroes new pages), write this rank's rows of every tensor into it, one
one-element all-reduce per bucket to say the rows are in and one more before a bucket
reuses the buffer, and let the buffer go; no layout work, no tensor views. per tensor /
floor is then the most any such gather can gain over the per-tensor way on this machine,
and per bucket / floor what `BucketGather` spends above that least.

GB/s per proc = full bytes of the model / seconds of a pass (the slower rank's), medians
over rounds; ratio = per bucket / per tensor, as the ratio of medians and the median of
the rounds' ratios (a round's two passes saw the same load). memcpy: `copy_` of the same
full tensors into preallocated ones (median of 3 after one untimed copy), and into new
tensors (page faults included, as each gather's new buffer has), once per round. The two
ways' tensors are checked equal bit for bit once per model and bucket size.

    python -m bench.fsdp_sync [--models h256x4,50M] [--bucket-mb 8,64,256] [--rounds 5]
                              [--out runs/bench_fsdp_sync/results.json]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from bench.common import announce

# with the gather's own layout and buffer (private), to time the floor with what it does
from colocate.engines.fsdp_gather import (
    BucketGather,
    _byte_parts,
    _layout,
    _shared_memory_token,
    _SharedBuffer,
    buffer_bytes,
    gather_full,
)
from colocate.engines.models import load_model
from colocate.engines.parallel import shard
from colocate.engines.tiny import write_tiny_model
from colocate.engines.trainer import BUCKET_MB, cut_buckets

WORLD = 2
MIB = 1 << 20
# write_tiny_model's arguments: tests/test_fsdp.py's model, and bench/models.py's ~50M one
MODELS = {
    "h256x4": dict(architecture="qwen2", alphabet="0123456789+=>#", hidden_size=256,
                   layers=4, heads=4, kv_heads=2, intermediate_size=1024,
                   tie_embeddings=True),
    "50M": dict(architecture="qwen2", alphabet="0123456789+-*/=>#", hidden_size=512,
                layers=10, heads=8, kv_heads=2, intermediate_size=2816, max_positions=128,
                tie_embeddings=True),
}
MEMCPY_REPEATS = 3


def per_tensor_gather(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The baseline: a per-tensor gather over gloo, kept here only to be measured
    (`BucketGather` is what the trainer uses). One buffer for the bucket, each tensor's
    part padded to a multiple of the world in rows; per tensor, each rank copies its shard
    into its chunk of that part and every rank's chunk is broadcast in place (`world`
    broadcasts a tensor)."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    rows = [math.ceil(t.shape[0] / world) for t in tensors]
    sizes = [r * world * math.prod(t.shape[1:]) for t, r in zip(tensors, rows, strict=True)]
    buffer = torch.empty(sum(sizes), dtype=tensors[0].dtype)
    full, offset, pending = [], 0, []
    for tensor, chunk, numel in zip(tensors, rows, sizes, strict=True):
        out = buffer[offset:offset + numel].view(chunk * world, *tensor.shape[1:])
        offset += numel
        local = tensor.to_local()
        mine = out[rank * chunk:][:chunk]
        mine[:local.shape[0]] = local
        mine[local.shape[0]:] = 0
        pending += [dist.broadcast(out[index * chunk:(index + 1) * chunk], src=index,
                                   async_op=True) for index in range(world)]
        full.append(out[:tensor.shape[0]])
    for work in pending:
        work.wait()
    return full


def buckets(state: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """`state`'s tensors cut as `PolicyTrainer.weights` cuts them."""
    return [[tensor for _, tensor in bucket] for bucket in cut_buckets(state, bucket_bytes)]


def timed_pass(way: str, bucket_list: list[list[torch.Tensor]], floor: tuple) -> float:
    """Seconds for one pass (every bucket gathered, then let go), the slower rank's;
    `floor`: `floor_pass`'s arguments."""
    if way == "floor":
        return floor_pass(*floor)
    dist.barrier()
    start = time.perf_counter()
    with BucketGather(max(map(buffer_bytes, bucket_list))) as gather:  # as the trainer does
        for bucket in bucket_list:
            full = gather(bucket) if way == "per bucket" else per_tensor_gather(bucket)
            del full
    seconds = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds)


def floor_plan(bucket_list: list[list[torch.Tensor]]
               ) -> tuple[int, list[list[tuple[torch.Tensor, int]]]]:
    """What the floor pass writes: the largest bucket's buffer size, and per bucket this
    rank's rows as bytes with their byte offset in the buffer (as BucketGather lays it)."""
    rank, largest, plan = dist.get_rank(), 0, []
    for bucket in bucket_list:
        layout = _layout(bucket)
        offsets, total = _byte_parts(bucket, layout)
        largest = max(largest, total)
        writes = []
        for tensor, rows, offset in zip(bucket, layout, offsets, strict=True):
            local = tensor.to_local().contiguous()
            row_bytes = math.prod(tensor.shape[1:]) * tensor.element_size()
            writes.append((local.view(-1).view(torch.uint8), offset + rank * rows * row_bytes))
        plan.append(writes)
    return largest, plan


def floor_pass(largest: int, plan: list[list[tuple[torch.Tensor, int]]], token: str) -> float:
    """Seconds of the floor (module docstring) for one pass, the slower rank's."""
    flag = torch.zeros(1)
    dist.barrier()
    start = time.perf_counter()
    buffer = _SharedBuffer.make(token, largest, dist.get_rank(), WORLD)
    whole = buffer.bytes(largest)
    for number, writes in enumerate(plan):
        for rows, offset in writes:
            whole[offset:offset + rows.numel()].copy_(rows)
        dist.all_reduce(flag)  # every rank's rows are in
        if number + 1 < len(plan):
            dist.all_reduce(flag)  # every rank let the bucket go
    buffer.path.unlink(missing_ok=True)
    del whole, buffer
    seconds = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds)


def rank_main(rank: int, port: int, path: str, bucket_mbs: list[int], rounds: int,
              out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = load_model(path)
    shard(model, mixed_precision=False)
    state = model.state_dict()
    assert all(isinstance(t, DTensor) and t.placements == (Shard(0),) for t in state.values())
    sizes = [t.numel() * t.element_size() for t in state.values()]
    full_bytes = sum(sizes)
    reference = [t.full_tensor() for t in state.values()]
    warm = [torch.empty_like(t) for t in reference]
    token = _shared_memory_token(dist.group.WORLD)
    assert token is not None, "the ranks do not share /dev/shm"
    results = []
    for bucket_mb in bucket_mbs:
        bucket_list = buckets(state, bucket_mb * MIB)
        exact = all(
            torch.equal(a.view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))
            for bucket in bucket_list
            for a, b in zip(per_tensor_gather(bucket), gather_full(bucket), strict=True))
        ways = ["per tensor", "per bucket", "floor"]
        floor = (*floor_plan(bucket_list), token)
        for way in ways:
            timed_pass(way, bucket_list, floor)  # warm-up
        times: dict[str, list[float]] = {name: [] for name in ways}
        memcpy, memcpy_new = [], []
        for number in range(rounds):
            order = ways if number % 2 == 0 else list(reversed(ways))
            for name in order:
                times[name].append(timed_pass(name, bucket_list, floor))
            for dst, src in zip(warm, reference, strict=True):
                dst.copy_(src)
            copies = []
            for _ in range(MEMCPY_REPEATS):
                start = time.perf_counter()
                for dst, src in zip(warm, reference, strict=True):
                    dst.copy_(src)
                copies.append(time.perf_counter() - start)
            memcpy.append(statistics.median(copies))
            start = time.perf_counter()
            fresh = [src.clone() for src in reference]
            memcpy_new.append(time.perf_counter() - start)
            del fresh
        results.append({
            "bucket_mb": bucket_mb, "buckets": len(bucket_list), "exact": exact,
            "tensors": len(sizes), "full_bytes": full_bytes, "largest_bytes": max(sizes),
            "times": times, "memcpy_s": memcpy, "memcpy_new_s": memcpy_new})
    Path(out, f"{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def run_model(name: str, bucket_mbs: list[int], rounds: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as root:
        path = str(write_tiny_model(Path(root, "model"), **MODELS[name]))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        context = multiprocessing.get_context("spawn")
        procs = [context.Process(target=rank_main,
                                 args=(rank, port, path, bucket_mbs, rounds, root))
                 for rank in range(WORLD)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        if any(proc.exitcode for proc in procs):
            raise RuntimeError(f"{name}: a rank failed")
        return [json.loads(Path(root, f"{rank}.json").read_text()) for rank in range(WORLD)]


def loadavg() -> str:
    return " / ".join(Path("/proc/loadavg").read_text().split()[:3])


def paired_ratio(row: dict[str, Any]) -> float:
    """A row's per bucket / per tensor, the lower of its two readings."""
    return min(row["ratio_of_medians"], row["median_round_ratio"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="h256x4,50M")
    parser.add_argument("--bucket-mb", default="8,64,256")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="runs/bench_fsdp_sync/results.json")
    args = parser.parse_args()
    info, command = announce()
    bucket_mbs = [int(mb) for mb in args.bucket_mb.split(",")]
    rows = []
    print("| model | MiB | tensors | largest MiB | bucket MiB | buckets | per tensor GB/s | "
          "per bucket GB/s | ratio of medians | median of round ratios | floor GB/s | "
          "per tensor / floor | per bucket / floor | memcpy GB/s | memcpy into new GB/s | "
          "bit-exact | load average |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for name in args.models.split(","):
        before = loadavg()
        ranks = run_model(name, bucket_mbs, args.rounds)
        after = loadavg()
        for entry in ranks[0]:
            rate = {way: entry["full_bytes"] / statistics.median(seconds) / 1e9
                    for way, seconds in entry["times"].items()}
            paired = statistics.median(
                old / new for old, new in zip(entry["times"]["per tensor"],
                                              entry["times"]["per bucket"], strict=True))
            # memcpy: each proc's own, the slower proc's median
            memcpy = min(entry["full_bytes"] / statistics.median(r[i]["memcpy_s"]) / 1e9
                         for r in ranks for i in range(len(r)) if r[i] is not None
                         and r[i]["bucket_mb"] == entry["bucket_mb"])
            memcpy_new = min(entry["full_bytes"] / statistics.median(r[i]["memcpy_new_s"])
                             / 1e9 for r in ranks for i in range(len(r))
                             if r[i]["bucket_mb"] == entry["bucket_mb"])
            exact = all(r[i]["exact"] for r in ranks for i in range(len(r))
                        if r[i]["bucket_mb"] == entry["bucket_mb"])
            row = {"model": name, "bucket_mb": entry["bucket_mb"],
                   "full_mib": entry["full_bytes"] / MIB, "tensors": entry["tensors"],
                   "largest_mib": entry["largest_bytes"] / MIB, "buckets": entry["buckets"],
                   "per_tensor_gbs": rate["per tensor"], "per_bucket_gbs": rate["per bucket"],
                   "ratio_of_medians": rate["per bucket"] / rate["per tensor"],
                   "median_round_ratio": paired, "floor_gbs": rate["floor"],
                   "ceiling": rate["floor"] / rate["per tensor"],
                   "over_floor": rate["floor"] / rate["per bucket"], "memcpy_gbs": memcpy,
                   "memcpy_new_gbs": memcpy_new, "exact": exact,
                   "load_average": f"{before} -> {after}", "times": entry["times"]}
            rows.append(row)
            print(f"| {name} | {row['full_mib']:.1f} | {row['tensors']} | "
                  f"{row['largest_mib']:.2f} | {row['bucket_mb']} | {row['buckets']} | "
                  f"{row['per_tensor_gbs']:.2f} | {row['per_bucket_gbs']:.2f} | "
                  f"{row['ratio_of_medians']:.2f} | {row['median_round_ratio']:.2f} | "
                  f"{row['floor_gbs']:.2f} | {row['ceiling']:.2f} | {row['over_floor']:.2f} | "
                  f"{row['memcpy_gbs']:.2f} | {row['memcpy_new_gbs']:.2f} | "
                  f"{'yes' if exact else 'NO'} | {row['load_average']} |", flush=True)
    worst = min(paired_ratio(r) for r in rows)
    print(f"summary: per bucket / per tensor {worst:.2f}x at worst "
          f"(target >= 3x: {'PASS' if worst >= 3 else 'FAIL'})")
    at_default = [paired_ratio(r) for r in rows if r["bucket_mb"] == BUCKET_MB]
    if at_default:
        print(f"  at the default bucket_mb ({BUCKET_MB}): {min(at_default):.2f}x at worst "
              f"(target >= 3x: {'PASS' if min(at_default) >= 3 else 'FAIL'})")
    for row in rows:
        if paired_ratio(row) < 3:
            print(f"  {row['model']} at {row['bucket_mb']} MiB: the floor allows at most "
                  f"{row['ceiling']:.2f}x over per tensor; per bucket takes "
                  f"{row['over_floor']:.2f}x the floor's time (within 1.5x: "
                  f"{'PASS' if row['over_floor'] <= 1.5 else 'FAIL'})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": info, "command": command,
                                          "rounds": args.rounds, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
