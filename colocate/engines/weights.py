"""Moving weights between engines: by name into a model's own tensors, through shared
memory between processes of one host, and over Monarch RDMA buffers between hosts.

Weights travel as `(name, tensor)` pairs with Hugging Face names, or as a `WeightStream`:
every name's shape known first, the tensors a bucket at a time (a sharded trainer gathers
them bucket by bucket); `weight_copy.copy_weights` writes them into a model's own tensors.
Between
processes, `export_weights` writes them into one file under /dev/shm, in place over the
last export, and returns a small `WeightManifest` (what a message carries);
`read_exported` hands views of that file to a loader, so the reader copies straight from
shared memory, then checks that no export overwrote them meanwhile. Both sides keep their
mapping of the file, so a repeated sync writes and reads pages already in place; the file
(named with its writer's pid) goes when its writer's process exits, or, if it is killed,
when the runtime stops or replaces its proc. Across hosts, `offer_weights` wraps each tensor in a
`monarch.rdma.RDMABuffer` (ibverbs where the hosts have it, else Monarch's TCP transport)
and `fetch_weights` reads them all, in parallel, into new tensors. Within one process, a
tenant `publish`es its weights by name and a colocated tenant reads them in place
(`published`).
"""

from __future__ import annotations

import atexit
import hashlib
import math
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from colocate.shm_files import record as record_shm

ALIGN = 64
T = TypeVar("T")
WeightSource = Callable[[], "WeightStream"]
_published: dict[str, WeightSource] = {}


def publish(name: str, source: WeightSource) -> None:
    """Make tenant `name`'s weights reachable by name from this process (a handoff's
    target reads them in place)."""
    _published[name] = source


def published(name: str) -> WeightStream:
    """The weights tenant `name` published in this process."""
    if name not in _published:
        raise LookupError(f"no tenant {name!r} published weights in process {os.getpid()} "
                          f"(published here: {sorted(_published)}); a handoff needs both "
                          "tenants on the same procs (one resource group)")
    return _published[name]()


@dataclass(frozen=True)
class WeightStream:
    """Weights by Hugging Face name, a bucket at a time: every name's shape and dtype known
    up front (`specs`), the tensors made only as `buckets()` is iterated. A sharded
    trainer gathers each bucket when it is asked for, so no more than one bucket of full
    tensors exists at once."""

    specs: dict[str, tuple[tuple[int, ...], torch.dtype]]
    buckets: Callable[[], Iterator[list[tuple[str, torch.Tensor]]]]

    @classmethod
    def of(cls, named: Iterable[tuple[str, torch.Tensor]]) -> WeightStream:
        """A stream of one bucket over tensors that already exist."""
        pairs = list(named)
        return cls({name: (tuple(t.shape), t.dtype) for name, t in pairs},
                   lambda: iter([list(pairs)]))

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every (name, tensor), bucket after bucket; each is let go as it is handed over,
        so a bucket is gone before the next one is made (gathered)."""
        for bucket in self.buckets():
            bucket.reverse()
            while bucket:
                yield bucket.pop()


def as_stream(weights: WeightStream | Iterable[tuple[str, torch.Tensor]]) -> WeightStream:
    """`weights` as a stream: itself, or a stream of one bucket over the given pairs."""
    return weights if isinstance(weights, WeightStream) else WeightStream.of(weights)


def digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over names and bytes, in name order: equal digests, equal weights."""
    sha = hashlib.sha256()
    for name, tensor in sorted(named, key=lambda item: item[0]):
        sha.update(name.encode())
        sha.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


@dataclass(frozen=True)
class WeightManifest:
    """Where exported weights lie: one file, and each tensor's dtype, shape and offset."""

    path: str
    nbytes: int
    entries: tuple[tuple[str, str, tuple[int, ...], int], ...]  # name, dtype, shape, offset
    version: int = 0


class StaleWeightsError(RuntimeError):
    """Exported weights were overwritten (or removed) before a reader was done with them."""


WRITING = -1  # the header's value while an export writes


def shm_dir() -> Path:
    """This user's folder for shared-memory files of weights (/dev/shm, else the temp dir)."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    path = base / f"colocate-weights-{os.getuid()}"
    path.mkdir(exist_ok=True)
    return path


_mappings: dict[str, tuple[tuple[int, int], torch.UntypedStorage]] = {}
_written: set[str] = set()  # export files this process made: removed when it exits


def _remove_at_exit(path: Path) -> None:
    if str(path) not in _written:
        _written.add(str(path))
        atexit.register(path.unlink, missing_ok=True)


def _mapping(path: Path, nbytes: int) -> torch.UntypedStorage:
    """This process's shared mapping of the `nbytes` file at `path`, kept across calls and
    made again when the file was replaced."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        raise StaleWeightsError(f"exported weights {path} are gone (removed, or another "
                                "host's /dev/shm): export them again on this host") from None
    if stat.st_size != nbytes:
        raise StaleWeightsError(f"{path} holds {stat.st_size} bytes, not {nbytes}: it was "
                                "exported again with other tensors; sync again")
    identity = (stat.st_ino, stat.st_size)
    cached = _mappings.get(str(path))
    if cached is None or cached[0] != identity:
        storage = torch.UntypedStorage.from_file(str(path), shared=True, nbytes=nbytes)
        cached = _mappings[str(path)] = (identity, storage)
    return cached[1]


def _header(storage: torch.UntypedStorage) -> torch.Tensor:
    return _view(storage, torch.int64, (1,), 0)


def export_weights(weights: WeightStream | Iterable[tuple[str, torch.Tensor]], key: str,
                   version: int = 0) -> WeightManifest:
    """Write the weights into the shared-memory file of `key`, over its last export, a
    bucket at a time (the file's layout comes from the stream's specs). Its header says
    `WRITING` until every tensor is in, then `version` (>= 0)."""
    if version < 0:
        raise ValueError(f"version={version}: must be >= 0")
    stream = as_stream(weights)
    entries, offset = [], ALIGN  # the header comes first
    for name, (shape, dtype) in stream.specs.items():
        entries.append((name, str(dtype).removeprefix("torch."), tuple(shape), offset))
        offset += -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN
    # the writer's pid in the name: two runs of one user never share a file, and the
    # runtime removes it if the writer is killed (shm_files; atexit does at a normal exit)
    path = shm_dir() / f"{key.replace('/', '_')}-{os.getpid()}.bin"
    if not path.exists():
        record_shm([path])
    if not path.exists() or path.stat().st_size != offset:  # a new file, all at once
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.truncate(offset)
        os.replace(tmp, path)
    _remove_at_exit(path)
    storage = _mapping(path, offset)
    starts = {name: start for name, _, _, start in entries}
    _header(storage).fill_(WRITING)
    for name, tensor in stream.tensors():
        if (tuple(tensor.shape), tensor.dtype) != stream.specs[name]:
            raise ValueError(f"{name}: {tuple(tensor.shape)} {tensor.dtype} is not what its "
                             f"stream announced, {stream.specs[name]} (the export stays "
                             "marked as being written)")
        _view(storage, tensor.dtype, tensor.shape, starts[name]).copy_(tensor.detach())
    _header(storage).fill_(version)
    return WeightManifest(str(path), offset, tuple(entries), version)


def read_exported(manifest: WeightManifest,
                  load: Callable[[Iterable[tuple[str, torch.Tensor]]], T]) -> T:
    """`load(views)` over the exported tensors (views of shared memory: `load` copies what
    it keeps), with the file checked to hold `manifest.version` before and after. Raises
    `StaleWeightsError` when it does not; after `load` ran, what it copied is torn then."""
    path = Path(manifest.path)
    storage = _mapping(path, manifest.nbytes)

    def check(when: str, consequence: str) -> None:
        found = int(_header(storage).item())
        if found != manifest.version:
            state = "being written" if found == WRITING else f"version {found}"
            raise StaleWeightsError(
                f"exported weights {path} are {state} {when}, not version "
                f"{manifest.version}: another export of the same key ran meanwhile; "
                f"{consequence}. Sync again, one export at a time per key.")

    check("before the read", "nothing was loaded")
    views = [(name, _view(storage, getattr(torch, dtype), shape, offset))
             for name, dtype, shape, offset in manifest.entries]
    loaded = load(views)
    check("after the read", "the loaded weights may be torn")
    return loaded


def _view(storage: torch.UntypedStorage, dtype: torch.dtype, shape, offset: int) -> torch.Tensor:
    count = 1
    for size in shape:
        count *= size
    flat = torch.tensor([], dtype=dtype).set_(storage, offset // dtype.itemsize, (count,))
    return flat.view(shape)


@dataclass(frozen=True)
class RemoteWeights:
    """Weights another host can read: each tensor's name, dtype and shape, and an RDMA
    buffer over its bytes. Valid while the offering process keeps the tensors alive."""

    entries: tuple[tuple[str, str, tuple[int, ...]], ...]  # name, dtype, shape
    buffers: tuple[Any, ...]  # monarch.rdma.RDMABuffer, one per entry
    version: int = 0


def offer_weights(named: Sequence[tuple[str, torch.Tensor]], version: int = 0
                  ) -> RemoteWeights:
    """RDMA buffers over the tensors themselves (no copy). Call it inside a Monarch actor
    and keep `named` alive until every reader has fetched."""
    from monarch.rdma import RDMABuffer

    not_contiguous = [name for name, t in named if not t.is_contiguous()]
    if not_contiguous:
        raise ValueError(f"offer_weights needs contiguous tensors; {not_contiguous[:5]} are "
                         "not (pass .contiguous() copies, and keep them alive)")
    entries = tuple((name, str(t.dtype).removeprefix("torch."), tuple(t.shape))
                    for name, t in named)
    buffers = tuple(RDMABuffer(t.detach().reshape(-1).view(torch.uint8)) for _, t in named)
    return RemoteWeights(entries, buffers, version)


def fetch_weights(remote: RemoteWeights, timeout_s: int = 60
                  ) -> list[tuple[str, torch.Tensor]]:
    """Read every offered tensor into a new CPU tensor (all reads in flight at once); blocks
    until all arrived (call it from a synchronous endpoint)."""
    tensors = [(name, torch.empty(shape, dtype=getattr(torch, dtype)))
               for name, dtype, shape in remote.entries]
    reads = [buffer.read_into(t.reshape(-1).view(torch.uint8), timeout=timeout_s)
             for buffer, (_, t) in zip(remote.buffers, tensors, strict=True)]
    for read in reads:
        read.get()
    return tensors

