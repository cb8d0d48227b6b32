"""`fsdp_gather` on real gloo process groups of 2 and 3 CPU procs: bit for bit
`DTensor.full_tensor()`, two small all-reduces per bucket (through shared memory) however
many tensors it holds, a buffer reused only once every rank let it go, a peak within one
bucket + its largest tensor read from the kernel's peak RSS, and the broadcasts when ranks
cannot share memory."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import multiprocessing
import os
import socket
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from colocate.engines import fsdp_gather
from colocate.engines.fsdp_gather import gather_full
from colocate.engines.weights import shm_dir

MIB = 1 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(target, world: int, out: Path, env: dict[str, str] | None = None) -> list[dict]:
    """Run `target(rank, world, port, out)` in `world` spawned procs; their JSON results."""
    port = _free_port()
    saved = dict(os.environ)
    os.environ.update(env or {})  # a spawned child reads its environment as it starts
    try:
        context = multiprocessing.get_context("spawn")
        procs = [context.Process(target=target, args=(rank, world, port, str(out)))
                 for rank in range(world)]
        for proc in procs:
            proc.start()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    for proc in procs:
        proc.join(timeout=240)
    assert [proc.exitcode for proc in procs] == [0] * world, "a rank failed"
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(world)]


def _join(rank: int, world: int, port: int):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return init_device_mesh("cpu", (world,))


def _awkward(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bits of `dtype` (NaNs with assorted payloads and infinities among them for
    floats), with a -0.0 and a NaN of a set payload written in."""
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16,
            torch.int64: torch.int64}[dtype]
    info = torch.iinfo(bits)
    tensor = torch.randint(info.min, info.max, shape, dtype=bits,
                           generator=torch.Generator().manual_seed(seed)).view(dtype)
    if dtype.is_floating_point and tensor.numel() >= 2:
        flat = tensor.view(-1)
        flat[0] = -0.0
        flat.view(bits)[-1] = -1  # all ones: a negative NaN with a full payload
    return tensor


def _same_bits(mine: torch.Tensor, theirs: torch.Tensor) -> bool:
    if mine.shape != theirs.shape or mine.dtype != theirs.dtype:
        return False
    if mine.numel() == 0:
        return True
    return torch.equal(mine.contiguous().view(torch.uint8), theirs.contiguous().view(torch.uint8))


# Buckets: (shape, dtype) per tensor. Rows that do not divide by 2 or 3 (ranks with fewer
# rows), tensors of fewer rows than ranks (ranks with none), fp32, bf16 and int64 mixed in
# one bucket, 1-D to 3-D.
BUCKETS = [
    [((5, 3), torch.float32), ((7,), torch.bfloat16), ((1, 4), torch.bfloat16),
     ((8, 2, 3), torch.float32), ((2, 5), torch.int64), ((3,), torch.float32)],
    [((17, 64), torch.float32), ((11,), torch.float32), ((64, 33), torch.float32)],
    [((9, 5), torch.bfloat16), ((1,), torch.bfloat16), ((2, 3), torch.bfloat16),
     ((40, 7), torch.bfloat16)],
    [((1, 1), torch.float32)],
]


def exact_rank(rank: int, world: int, port: int, out: str) -> None:
    mesh = _join(rank, world, port)
    results = []
    for number, bucket in enumerate(BUCKETS):
        tensors: list[torch.Tensor] = [
            distribute_tensor(_awkward(shape, dtype, seed=100 * number + index), mesh,
                              [Shard(0)])
            for index, (shape, dtype) in enumerate(bucket)]
        # a replicated DTensor (gathered by full_tensor) and a plain tensor, returned as is
        tensors.insert(1, distribute_tensor(_awkward((3, 2), torch.float32, 7), mesh,
                                            [Replicate()]))
        plain = torch.arange(4.0)
        tensors.append(plain)
        full = gather_full(tensors)
        packed = [f for f, t in zip(full, tensors, strict=True)
                  if isinstance(t, DTensor) and t.placements == (Shard(0),)]
        results.append({
            "exact": [_same_bits(f, t.full_tensor() if isinstance(t, DTensor) else t)
                      for f, t in zip(full, tensors, strict=True)],
            "plain_as_is": full[-1] is plain,
            "buffers": len({f.untyped_storage().data_ptr() for f in packed}),
            "nans": sum(int(f.isnan().sum()) for f in full if f.dtype.is_floating_point),
            "negative_zeros": sum(int(((f == 0) & f.signbit()).sum())
                                  for f in full if f.dtype.is_floating_point)})
    Path(out, f"{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_gather_full_gives_full_tensor_bit_for_bit(tmp_path, world):
    """Every tensor of every bucket equals `full_tensor()`'s in every bit (-0.0 and NaN
    payloads, bf16, fp32 and int64 in one buffer, uneven rows, ranks without rows), the
    packed ones are views of one buffer, and plain tensors come back as they are."""
    ranks = _spawn(exact_rank, world, tmp_path)
    for results in ranks:
        for bucket in results:
            assert all(bucket["exact"]), bucket
            assert bucket["plain_as_is"]
            assert bucket["buffers"] == 1
        assert sum(bucket["nans"] for bucket in results) > 0
        assert sum(bucket["negative_zeros"] for bucket in results) > 0


@contextlib.contextmanager
def _counting() -> Iterator[dict[str, list[int]]]:
    """This proc's broadcasts and all-reduces while inside: the bytes of each, by name."""
    calls: dict[str, list[int]] = {"broadcast": [], "all_reduce": []}
    real = {name: getattr(dist, name) for name in calls}

    def counter(name: str):
        def counted(tensor, *args, **kwargs):
            calls[name].append(tensor.numel() * tensor.element_size())
            return real[name](tensor, *args, **kwargs)
        return counted

    for name in calls:
        setattr(dist, name, counter(name))
    try:
        yield calls
    finally:
        for name, function in real.items():
            setattr(dist, name, function)


def count_rank(rank: int, world: int, port: int, out: str) -> None:
    """Three buckets of 100 small tensors and a large one, in one pass that lets each
    bucket go before the next: collectives counted, buffers compared. Then a pass that
    keeps every bucket."""
    mesh = _join(rank, world, port)
    buckets = [[distribute_tensor(_awkward((3, 5), torch.float32, 1000 * b + index), mesh,
                                  [Shard(0)]) for index in range(100)]
               + [distribute_tensor(_awkward((301, 10), torch.float32, b), mesh, [Shard(0)])]
               for b in range(3)]
    expected = [[t.full_tensor() for t in bucket] for bucket in buckets]
    gather_full(buckets[0][:1])  # finds the shared folder: 2 collectives, once a group
    exact, buffers = [], []
    with _counting() as calls, fsdp_gather.BucketGather() as gather:
        for bucket, want in zip(buckets, expected, strict=True):
            full = gather(bucket)
            exact.append(all(_same_bits(f, w) for f, w in zip(full, want, strict=True)))
            buffers.append(full[0].untyped_storage().data_ptr())
            del full
    with fsdp_gather.BucketGather() as gather:
        kept = [gather(bucket) for bucket in buckets]
    kept_exact = all(_same_bits(f, w) for full, want in zip(kept, expected, strict=True)
                     for f, w in zip(full, want, strict=True))
    # buckets that grow, each let go before the next: buffers made without and with the
    # pass's capacity given ahead
    growing = [[distribute_tensor(_awkward((rows, 10), torch.float32, rows), mesh,
                                  [Shard(0)])] for rows in (3, 301, 601)]
    made = {}
    for capacity in (0, max(map(fsdp_gather.buffer_bytes, growing))):
        before = sum(fsdp_gather._serials.values())
        with fsdp_gather.BucketGather(capacity) as gather:
            grown_exact = all(_same_bits(gather(bucket)[0], bucket[0].full_tensor())
                              for bucket in growing)
        made[str(capacity)] = (sum(fsdp_gather._serials.values()) - before, grown_exact)
    Path(out, f"{rank}.json").write_text(json.dumps({
        "calls": calls, "exact": exact, "kept_exact": kept_exact, "buffers": buffers,
        "kept_buffers": [full[0].untyped_storage().data_ptr() for full in kept],
        "made": made}))
    dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_a_pass_takes_two_small_all_reduces_a_bucket_and_reuses_a_let_go_buffer(tmp_path):
    """Three buckets of 101 tensors: no broadcast, and 5 one-element all-reduces (1 for the
    first bucket, 2 for each after). A bucket let go on every rank leaves its buffer to
    the next; buckets kept by the caller each get their own, and keep their values.
    Buckets that grow make a buffer each, unless the pass's capacity was given ahead."""
    ranks = _spawn(count_rank, 2, tmp_path)
    for rank in ranks:
        assert rank["calls"] == {"broadcast": [], "all_reduce": [8] * 5}  # int64 flags
        assert all(rank["exact"]) and rank["kept_exact"]
        assert len(set(rank["buffers"])) == 1
        assert len(set(rank["kept_buffers"])) == 3
        without, with_capacity = rank["made"].values()
        assert without == [3, True], rank["made"]
        assert with_capacity == [1, True], rank["made"]
    assert not list(shm_dir().glob("gather-*")), "a shared buffer's file was left behind"


def _status() -> dict[str, int]:
    with open("/proc/self/status") as status:
        return {key: int(value.split()[0]) * 1024 for key, _, value in
                (line.partition(":") for line in status) if key in ("VmRSS", "VmHWM")}


def peak_rank(rank: int, world: int, port: int, out: str) -> None:
    """The peak RSS one gather adds, over the bucket and its largest tensor."""
    mesh = _join(rank, world, port)
    shapes = [(1001, 1024), (257, 1024), (3, 1024), (2049, 1024), (513, 1024), (7,)]
    tensors = []
    for shape in shapes:
        rows = math.ceil(shape[0] / world)
        local = torch.randn(max(0, min(rows, shape[0] - rank * rows)), *shape[1:])
        tensors.append(DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                          shape=torch.Size(shape),
                                          stride=torch.empty(shape, device="meta").stride()))
    bucket = sum(math.prod(shape) * 4 for shape in shapes)
    largest = max(math.prod(shape) * 4 for shape in shapes)
    extras = []
    for _ in range(3):
        dist.barrier()
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # VmHWM := VmRSS
        before = _status()["VmRSS"]
        full = gather_full(tensors)
        extras.append(_status()["VmHWM"] - before)
        del full
    Path(out, f"{rank}.json").write_text(json.dumps(
        {"extras": extras, "bucket": bucket, "largest": largest}))
    dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_a_gather_peaks_within_a_bucket_and_its_largest_tensor(tmp_path):
    """Peak RSS over a gather (the kernel's VmHWM, reset as it starts) of a 15 MiB bucket
    whose largest tensor is 8 MiB: at least the bucket (the result is resident), at most
    the bucket + the largest tensor + 1 MiB (Python's and gloo's own). glibc's mmap
    threshold is fixed, so a freed buffer leaves RSS instead of staying in the heap."""
    ranks = _spawn(peak_rank, 2, tmp_path, env={"MALLOC_MMAP_THRESHOLD_": "65536"})
    for rank in ranks:
        for extra in rank["extras"]:
            assert rank["bucket"] <= extra <= rank["bucket"] + rank["largest"] + MIB, \
                (extra / MIB, rank["bucket"] / MIB, rank["largest"] / MIB)


def apart_rank(rank: int, world: int, port: int, out: str) -> None:
    """A bucket gathered while rank 1 looks for shared files in another folder (as another
    host or container would); then, on a new group, with /dev/shm out of room on rank 1
    (a fault the test cannot cause for real: posix_fallocate raising ENOSPC)."""
    mesh = _join(rank, world, port)
    tensors = [distribute_tensor(_awkward((7, 3), torch.float32, index), mesh, [Shard(0)])
               for index in range(4)]
    expected = [t.full_tensor() for t in tensors]
    results = {}
    if rank == 1:
        fsdp_gather.shm_dir = lambda: Path(out)
    with _counting() as calls:
        full = gather_full(tensors)
    results["apart"] = {"exact": all(_same_bits(f, w) for f, w in
                                     zip(full, expected, strict=True)),
                        "broadcasts": len(calls["broadcast"])}
    fsdp_gather.shm_dir = shm_dir
    mesh = DeviceMesh.from_group(dist.new_group(backend="gloo"), "cpu")
    tensors = [distribute_tensor(w, mesh, [Shard(0)]) for w in expected]
    if rank == 1:
        def no_room(*_):
            raise OSError(errno.ENOSPC, "No space left on device")
        os.posix_fallocate = no_room
    with _counting() as calls, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        full = gather_full(tensors)
    results["no_room"] = {"exact": all(_same_bits(f, w) for f, w in
                                       zip(full, expected, strict=True)),
                          "broadcasts": len(calls["broadcast"]),
                          "warnings": [str(w.message) for w in caught]}
    Path(out, f"{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_ranks_that_cannot_share_memory_gather_by_broadcasts(tmp_path):
    """Ranks that do not see one shared folder gather by broadcasts, bit for bit; a
    shared buffer that cannot be made on one rank makes every rank warn, saying what to
    do, and gather that bucket by broadcasts."""
    for rank in _spawn(apart_rank, 2, tmp_path):
        assert rank["apart"]["exact"] and rank["apart"]["broadcasts"] == 4 * 2
        assert rank["no_room"]["exact"] and rank["no_room"]["broadcasts"] == 4 * 2
        assert len(rank["no_room"]["warnings"]) == 1
        assert "--shm-size" in rank["no_room"]["warnings"][0]
    assert not list(shm_dir().glob("gather-*"))
