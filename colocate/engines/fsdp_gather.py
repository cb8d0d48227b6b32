"""Full tensors of FSDP2-sharded parameters, a bucket at a time, gathered into one buffer.

`DTensor.full_tensor()` pads the local shard, gathers into a padded tensor and copies out
the unpadded rows: two to three transient copies of each tensor, so for a bucket of
tensors up to three times the bucket at a sync's peak. Here a bucket gets one flat
buffer, sized to the sum of its tensors' padded sizes (each tensor rounded up to a
multiple of the world size in rows). Each tensor is gathered straight into its part of
that buffer, and the full tensor is the leading rows of that part: a view, no copy.

- NCCL: one `all_gather_into_tensor` per tensor, in place; a short local shard (the last
  ranks' chunks when the first dim does not divide) is padded into a temporary chunk.
- gloo: its all-gather goes through a flat temporary of the whole output
  (`AsyncAllgatherWork` in ProcessGroupGloo.cpp), so instead each rank copies its shard
  into its own chunk of the buffer and broadcasts it from there: no temporary at all.

So a bucket's peak is its buffer plus at most one chunk: within "one bucket + the largest
tensor". FSDP2 shards dim 0 as `torch.chunk` does: rank r holds rows [r*c, min((r+1)*c,
n)), with c = ceil(n / world). A tensor on another layout (HSDP's 2-D mesh, a non-dim-0
shard) is gathered with `full_tensor()`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


def gather_full(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The full tensors of `tensors` (DTensors sharded by FSDP2, or plain tensors, which
    are returned as they are), in order. Every rank of the tensors' mesh must call it with
    the same list."""
    layout = [_chunk_rows(t) if isinstance(t, DTensor) else None for t in tensors]
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


def _chunk_rows(tensor: DTensor) -> int | None:
    """Rows per rank when `tensor` is FSDP2's dim-0 shard on a 1-D mesh (and this rank's
    local shard has the rows that layout gives it); else None."""
    if tensor.device_mesh.ndim != 1 or tensor.placements != (Shard(0),) or tensor.ndim == 0:
        return None
    world, rank = tensor.device_mesh.size(), tensor.device_mesh.get_local_rank()
    rows = math.ceil(tensor.shape[0] / world)
    expected = max(0, min(rows, tensor.shape[0] - rank * rows))
    return rows if tensor.to_local().shape[0] == expected else None


def _padded_numel(tensor: DTensor, rows: int) -> int:
    return rows * tensor.device_mesh.size() * math.prod(tensor.shape[1:])
