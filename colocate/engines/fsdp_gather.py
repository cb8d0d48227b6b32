"""Full tensors of FSDP2-sharded parameters, a bucket at a time, gathered into one buffer.

`DTensor.full_tensor()` pads the local shard, gathers into a padded tensor and copies out
the unpadded rows: two to three transient copies of each tensor, so for a bucket of
tensors up to three times the bucket at a sync's peak. Here a bucket gets one flat
buffer, a part per tensor sized to its padded rows (each tensor rounded up to a multiple
of the world size in rows). Each rank's rows go straight into its chunk of that part, and
the full tensor is the leading rows of the part: a view, no copy.

- gloo, every rank on one host (procs on one node, as colocation runs them): the buffer is
  a shared-memory file that every rank maps. Each rank writes its rows into it, and one
  all-reduce of a flag says they are all written: no bytes cross a socket. A pass over a
  trainer's buckets (`BucketGather`) reuses the buffer for the next bucket once every rank
  has let the last one go (a second flag; if any rank still holds it, the next bucket
  gets a new buffer, so nothing handed out is ever overwritten). Where /dev/shm cannot
  hold a bucket, the gather warns and falls back to the next way.
- gloo across hosts: its all-gather goes through a flat temporary of the whole output
  (`AsyncAllgatherWork` in ProcessGroupGloo.cpp), so instead each rank copies its shard
  into its own chunk of the buffer and broadcasts it from there: no temporary at all.
- NCCL: one `all_gather_into_tensor` per tensor, in place; a short local shard (the last
  ranks' chunks when the first dim does not divide) is padded into a temporary chunk.

So a bucket's peak is its buffer plus at most one chunk: within "one bucket + the largest
tensor". FSDP2 shards dim 0 as `torch.chunk` does: rank r holds rows [r*c, min((r+1)*c,
n)), with c = ceil(n / world). A tensor on another layout (HSDP's 2-D mesh, a non-dim-0
shard) is gathered with `full_tensor()`.
"""

from __future__ import annotations

import math
import mmap
import os
import secrets
import sys
import warnings
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from colocate.engines.weights import ALIGN, shm_dir  # each tensor's part starts aligned


def gather_full(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The full tensors of `tensors` (DTensors sharded by FSDP2, or plain tensors, which
    are returned as they are), in order. Every rank of the tensors' mesh must call it with
    the same list."""
    with BucketGather() as gather:
        return gather(tensors)


class BucketGather:
    """Gathers the buckets of one pass over sharded weights, in order, each by
    `gather_full`'s rules; on one host over gloo, through one shared-memory buffer that
    the pass reuses from bucket to bucket. Every rank makes the same calls; `close` (or
    the end of a `with` block) lets the buffer go once the last bucket's tensors are.

    `capacity`: the largest `buffer_bytes` among the pass's buckets, when the caller knows
    them ahead; the first buffer is made that large, so a larger bucket later does not
    make a second one (new shared memory costs the kernel's zeroing of every page)."""

    def __init__(self, capacity: int = 0) -> None:
        self._buffer: _SharedBuffer | None = None
        self._shared_memory_failed = False
        self._capacity = capacity

    def __enter__(self) -> BucketGather:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._buffer = None  # unmapped once no tensor of the last bucket is left

    @torch.no_grad()  # so DTensor.to_local is its local tensor, not an autograd call
    def __call__(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        layout = _layout(tensors)
        sharded = [t for t, rows in zip(tensors, layout, strict=True) if rows is not None]
        if not sharded:
            return [t.full_tensor() if isinstance(t, DTensor) else t for t in tensors]
        mesh = sharded[0].device_mesh
        group = mesh.get_group()
        if (not self._shared_memory_failed and dist.get_backend(group) == "gloo"
                and all(t.device.type == "cpu" and (t.device_mesh is mesh
                                                    or t.device_mesh.get_group() is group)
                        for t in sharded)
                and _shared_memory_token(group) is not None):
            full = self._through_shared_memory(tensors, layout, group)
            if full is not None:
                return full
        return _gather_into_buffer(tensors, layout)

    def _through_shared_memory(self, tensors: list[torch.Tensor], layout: list[int | None],
                               group: dist.ProcessGroup) -> list[torch.Tensor] | None:
        """Each rank writes its rows into the shared buffer; None (on every rank alike)
        when the buffer could not be made on some rank."""
        parts, total = _byte_parts(tensors, layout)
        buffer = self._buffer
        if buffer is not None:  # was the last bucket let go, on every rank?
            held = torch.tensor([int(buffer.handed_out())])
            dist.all_reduce(held, op=dist.ReduceOp.MAX, group=group)
            if held.item() or buffer.nbytes < total:
                buffer = self._buffer = None
        fresh = buffer is None
        failure = ""
        world, rank = dist.get_world_size(group), dist.get_group_rank(group, dist.get_rank())
        if buffer is None:
            try:
                buffer = _SharedBuffer.make(_shared_memory_token(group),
                                            max(total, self._capacity, ALIGN), rank, world)
            except OSError as error:
                failure = f"{error}"
        whole = buffer.bytes(total) if buffer is not None else None
        full = []
        for tensor, rows, offset in zip(tensors, layout, parts, strict=True):
            if rows is None:
                full.append(tensor.full_tensor() if isinstance(tensor, DTensor) else tensor)
            elif whole is not None:
                shape = (rows * world, *tensor.shape[1:])
                nbytes = math.prod(shape) * tensor.element_size()
                out = whole[offset:offset + nbytes].view(tensor.dtype).view(shape)
                local = tensor.to_local()
                out[rank * rows:][:local.shape[0]] = local
                full.append(out[:tensor.shape[0]])
        del whole
        failed = torch.tensor([int(bool(failure))])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)  # every rank's rows in
        if fresh and buffer is not None:
            buffer.path.unlink(missing_ok=True)  # every rank has it mapped
        if failed.item():
            self._buffer, self._shared_memory_failed = None, True
            warnings.warn(f"FSDP weight gather: a {total}-byte shared-memory buffer could "
                          f"not be made ({failure or 'on another rank'}); gathering by "
                          f"broadcasts instead, which is slower. Give {shm_dir().parent} "
                          "more room (docker run --shm-size) or use smaller buckets "
                          "(bucket_mb).", stacklevel=3)
            return None
        self._buffer = buffer
        return full


class _SharedBuffer:
    """A shared-memory file mapped into this process, handing out tensor views of it."""

    def __init__(self, path: Path, nbytes: int, rank: int, world: int) -> None:
        self.path, self.nbytes = path, nbytes
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            # ENOSPC here, not SIGBUS on a write. Each rank starts at its own share of the
            # file, so the ranks zero the new pages side by side, then walk the rest.
            start = nbytes * rank // world // mmap.PAGESIZE * mmap.PAGESIZE
            os.posix_fallocate(descriptor, start, nbytes - start)
            if start:
                os.posix_fallocate(descriptor, 0, start)
            self._mapping = mmap.mmap(descriptor, nbytes, flags=mmap.MAP_SHARED
                                      | getattr(mmap, "MAP_POPULATE", 0))
        except OSError:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(descriptor)
        self._references_alone = sys.getrefcount(self._mapping)

    @classmethod
    def make(cls, token: str, nbytes: int, rank: int, world: int) -> _SharedBuffer:
        """The group's next buffer, as rank `rank` of `world` maps it: the ranks make the
        same calls, so they name the same file."""
        serial = _serials[token] = _serials.get(token, 0) + 1
        return cls(shm_dir() / f"gather-{token}-{serial}", nbytes, rank, world)

    def bytes(self, count: int) -> torch.Tensor:
        """Its first `count` bytes, as a tensor that keeps the mapping alive."""
        if count == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self._mapping, dtype=torch.uint8, count=count)

    def handed_out(self) -> bool:
        """Whether a tensor viewing this buffer is still alive (each holds the mapping)."""
        return sys.getrefcount(self._mapping) > self._references_alone


_tokens: weakref.WeakKeyDictionary[dist.ProcessGroup, str | None] = \
    weakref.WeakKeyDictionary()
_serials: dict[str, int] = {}  # buffers made so far, by group token


def _shared_memory_token(group: dist.ProcessGroup) -> str | None:
    """A name every rank of `group` agrees on for its shared buffers, or None when the
    ranks do not see one /dev/shm (other hosts, other containers). Found once per group:
    rank 0 makes a file and every rank looks for it."""
    if group in _tokens:
        return _tokens[group]
    first = dist.get_group_rank(group, dist.get_rank()) == 0
    box = [secrets.token_hex(8) if first else None]
    probe = shm_dir() / f"gather-{box[0]}-probe"
    if first:
        probe.touch()
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    seen = torch.tensor([int((shm_dir() / f"gather-{box[0]}-probe").exists())])
    dist.all_reduce(seen, op=dist.ReduceOp.MIN, group=group)
    if first:
        probe.unlink()
    _tokens[group] = box[0] if seen.item() else None
    return _tokens[group]


def buffer_bytes(tensors: list[torch.Tensor]) -> int:
    """The bytes of the shared buffer that gathering `tensors` (one bucket) takes; 0 when
    none of them is an FSDP2 shard. Reads shapes and meshes only: no data, no collective."""
    return _byte_parts(tensors, _layout(tensors))[1]


def _byte_parts(tensors: list[torch.Tensor], layout: list[int | None]
                ) -> tuple[list[int], int]:
    """Each sharded tensor's byte offset in a shared buffer (its padded rows, aligned),
    and the buffer's size."""
    offsets, total = [], 0
    for tensor, rows in zip(tensors, layout, strict=True):
        offsets.append(total)
        if rows is not None:
            nbytes = _padded_numel(tensor, rows) * tensor.element_size()
            total += -(-nbytes // ALIGN) * ALIGN
    return offsets, total


def _gather_into_buffer(tensors: list[torch.Tensor], layout: list[int | None]
                        ) -> list[torch.Tensor]:
    """By collectives, into one private buffer per bucket (one dtype) or one by one."""
    total = sum(_padded_numel(t, rows) for t, rows in zip(tensors, layout, strict=True)
                if rows is not None)
    dtypes = {t.dtype for t, rows in zip(tensors, layout, strict=True) if rows is not None}
    if total == 0 or len(dtypes) != 1:  # nothing sharded here, or mixed dtypes: one by one
        return [t.full_tensor() if isinstance(t, DTensor) else t for t in tensors]
    buffer = torch.empty(total, dtype=dtypes.pop(), device=tensors[0].device)
    full, offset, pending = [], 0, []
    for tensor, rows in zip(tensors, layout, strict=True):
        if rows is None:
            full.append(tensor.full_tensor() if isinstance(tensor, DTensor) else tensor)
            continue
        numel = _padded_numel(tensor, rows)
        world_rows = rows * tensor.device_mesh.size()
        out = buffer[offset:offset + numel].view(world_rows, *tensor.shape[1:])
        offset += numel
        group = tensor.device_mesh.get_group()
        if dist.get_backend(group) == "gloo":
            pending += _broadcast_chunks(out, tensor.to_local(), rows, group)
        else:
            pending += _all_gather(out, tensor.to_local(), rows, group)
        full.append(out[:tensor.shape[0]])
    for work in pending:
        work.wait()
    return full


def _broadcast_chunks(out: torch.Tensor, local: torch.Tensor, rows: int,
                      group: dist.ProcessGroup) -> list[dist.Work]:
    """Fill `out` (world x rows rows) by each rank broadcasting its chunk of it in place."""
    mine = out[dist.get_group_rank(group, dist.get_rank()) * rows:][:rows]
    mine[:local.shape[0]] = local
    mine[local.shape[0]:] = 0
    return [dist.broadcast(out[index * rows:(index + 1) * rows],
                           src=dist.get_global_rank(group, index), group=group, async_op=True)
            for index in range(dist.get_world_size(group))]


def _all_gather(out: torch.Tensor, local: torch.Tensor, rows: int,
                group: dist.ProcessGroup) -> list[dist.Work]:
    """Fill `out` with one all-gather in place (a short shard padded in a temporary)."""
    if local.shape[0] == rows and local.is_contiguous():
        return [dist.all_gather_into_tensor(out, local, group=group, async_op=True)]
    padded = local.new_zeros(rows, *local.shape[1:])
    padded[:local.shape[0]] = local
    dist.all_gather_into_tensor(out, padded, group=group)
    return []


def _layout(tensors: list[torch.Tensor]) -> list[int | None]:
    """`_chunk_rows` of each tensor (None for a plain tensor), asking each mesh its size
    and this rank's place once (tens of microseconds a question, for every tensor)."""
    places: dict[int, tuple[int, int]] = {}
    layout = []
    for tensor in tensors:
        if not isinstance(tensor, DTensor) or tensor.device_mesh.ndim != 1:
            layout.append(None)
            continue
        mesh = tensor.device_mesh
        if id(mesh) not in places:
            places[id(mesh)] = (mesh.size(), mesh.get_local_rank())
        layout.append(_chunk_rows(tensor, *places[id(mesh)]))
    return layout


def _chunk_rows(tensor: DTensor, world: int, rank: int) -> int | None:
    """Rows per rank when `tensor` is FSDP2's dim-0 shard on its 1-D mesh of `world`
    ranks, of which this is `rank` (and its local shard has the rows that layout gives
    it); else None."""
    if tensor.placements != (Shard(0),) or tensor.ndim == 0:
        return None
    rows = math.ceil(tensor.shape[0] / world)
    expected = max(0, min(rows, tensor.shape[0] - rank * rows))
    return rows if tensor.to_local().shape[0] == expected else None


def _padded_numel(tensor: DTensor, rows: int) -> int:
    return rows * tensor.device_mesh.size() * math.prod(tensor.shape[1:])
