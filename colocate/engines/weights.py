"""Moving weights between engines: by name into a model's own tensors, through shared
memory between processes of one host, and over Monarch RDMA buffers between hosts.

Weights travel as `(name, tensor)` pairs with Hugging Face names, or as a `WeightStream`:
every name's shape known first, the tensors a bucket at a time (a sharded trainer gathers
them bucket by bucket). `copy_weights` writes them into a model's existing tensors (no new
memory, addresses unchanged), after checking every name and shape; where each name is in
the model is planned at the first sync and kept while the model's tensors stay
(`CopyPlan`), and a bucket's small tensors are copied by one `torch._foreach_copy_`
(`bench/engines.py` on 2 CPU cores: 1.15x a per-tensor memcpy of the same tensors, the
per-tensor way 1.05x in the same run; not yet run on a GPU). Between
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
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from colocate.resources.shm_files import record as record_shm

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


def check_weights(own: dict[str, tuple[int, ...]], given: dict[str, tuple[int, ...]],
                  target: str) -> None:
    """Raise `ValueError` naming every missing, unknown and mis-shaped tensor of `given`
    against `own` (name -> shape); nothing has been written when it raises."""
    missing, unknown = sorted(own.keys() - given.keys()), sorted(given.keys() - own.keys())
    wrong = [f"{n}: {given[n]} != {own[n]}" for n in sorted(own.keys() & given.keys())
             if tuple(given[n]) != tuple(own[n])]
    if missing or unknown or wrong:
        raise ValueError(f"weights do not match {target} (nothing was written): missing "
                         f"{missing[:5]}, unknown {unknown[:5]}, wrong shapes {wrong[:5]}")


# A tensor at least this large is copied on its own (one memcpy, as a raw copy of it
# would be: its launch costs far less than its bytes); smaller ones go together, one
# `torch._foreach_copy_` per bucket, so their number costs one call, not one each.
# (Not yet timed on a GPU: 8 MiB is where an H100's ~1.3 TB/s device copy outlasts
# a copy_'s ~7 us of host time.)
ALONE_BYTES = 8 << 20

_planned: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # the modules of planned models
_changes = 0  # parameters, buffers and submodules registered on those modules since


def _registered(module: nn.Module, *_: object) -> None:
    global _changes
    if module in _planned:
        _changes += 1


for _hook in (torch.nn.modules.module.register_module_parameter_registration_hook,
              torch.nn.modules.module.register_module_buffer_registration_hook,
              torch.nn.modules.module.register_module_module_registration_hook):
    _hook(_registered)


class CopyPlan:
    """Where `copy_weights` writes into one model: its state_dict's tensors by name, with
    their shapes, made once by walking the model (`state_dict`, which costs more than the
    copy of a small model's weights on a GPU) and reused while `current()`.

    It stays current while no module of a planned model registered a parameter, buffer
    or submodule (global registration hooks count them), and each of the model's tensors is
    still the object its module holds, with the same shape: a tensor replaced
    (`module.weight = Parameter(...)`, `load_state_dict(assign=True)`), one whose `.data`
    changed shape, or a module added, and the next sync walks the model again. The copy
    writes into the objects themselves, so a `.data` swap of the same shape is followed.
    A model whose state_dict holds tensors no module holds (made by a state_dict hook)
    is walked at every sync."""

    def __init__(self, model: nn.Module) -> None:
        self.changes = _changes
        state = model.state_dict(keep_vars=True)
        self.tensors: dict[str, torch.Tensor] = dict(state)
        self.shapes: dict[str, tuple[int, ...]] = {n: tuple(t.shape) for n, t in state.items()}
        owners: dict[int, tuple[dict, str]] = {}
        for module in model.modules():
            _planned.add(module)
            # the dicts themselves: a lookup per sync in `current()` is what is cheap
            for slot in (module._parameters, module._buffers):  # noqa: SLF001
                for key, tensor in slot.items():
                    if tensor is not None:
                        owners.setdefault(id(tensor), (slot, key))
        distinct = {id(t): t for t in state.values()}
        self.cacheable = distinct.keys() <= owners.keys()
        self.slots = [(owners[i][0], owners[i][1], t, t.shape) for i, t in distinct.items()
                      if i in owners]
        counts: dict[int, int] = {}
        for tensor in state.values():
            counts[id(tensor)] = counts.get(id(tensor), 0) + 1
        self.tied = {i for i, count in counts.items() if count > 1}  # one tensor, two names

    def current(self) -> bool:
        """Whether the model still has these tensors, by name and shape."""
        return (self.cacheable and self.changes == _changes
                and all(slot.get(key) is tensor and tensor.shape == shape
                        for slot, key, tensor, shape in self.slots))

    def check(self, specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
              target: str) -> None:
        """`check_weights` of the stream's specs against the model; nothing is written."""
        shapes = self.shapes
        if specs.keys() == shapes.keys() and all(
                tuple(spec[0]) == shapes[name] for name, spec in specs.items()):
            return
        check_weights(shapes, {n: shape for n, (shape, _) in specs.items()}, target)


_plans: weakref.WeakKeyDictionary[nn.Module, CopyPlan] = weakref.WeakKeyDictionary()


def copy_plan(model: nn.Module) -> CopyPlan:
    """The model's `CopyPlan`: the cached one while it is current, else a new one."""
    plan = _plans.get(model)
    if plan is None or not plan.current():
        plan = _plans[model] = CopyPlan(model)
    return plan


def copy_weights(model: nn.Module, weights: WeightStream | Iterable[tuple[str, torch.Tensor]]
                 ) -> int:
    """Copy every weight into `model`'s tensor of that name, a bucket at a time; returns the
    bytes given. All names and shapes (the stream's specs) are checked first, so a bad set
    writes nothing. Every tensor of the model must be given. Where the model is found is
    planned once (`copy_plan`); each bucket is copied with one `torch._foreach_copy_` for
    its small tensors of one dtype and device pair and one `copy_` for each large one
    (`ALONE_BYTES`). A name given twice for one tied tensor from one source tensor (a tied
    trainer's embedding and head) is copied once."""
    stream = as_stream(weights)
    plan = copy_plan(model)
    plan.check(stream.specs, "the model")
    copied = 0
    written: dict[int, tuple] = {}  # of tied targets: what was copied into them
    with torch.no_grad():
        for bucket in stream.buckets():
            copied += _copy_bucket(plan, bucket, written)
            del bucket  # gone before the next bucket is made (gathered)
    return copied


def _copy_bucket(plan: CopyPlan, bucket: list[tuple[str, torch.Tensor]],
                 written: dict[int, tuple]) -> int:
    """Copy one bucket into the planned tensors; the bytes given."""
    together: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    alone: list[tuple[torch.Tensor, torch.Tensor]] = []
    copied = 0
    for name, source in bucket:
        target = plan.tensors.get(name)
        if target is None or source.shape != target.shape:
            raise ValueError(
                f"{name}: a bucket gave {tuple(source.shape)}, where its stream announced "
                f"{plan.shapes.get(name)} (the model's is "
                f"{tuple(target.shape) if target is not None else 'none'}); the buckets "
                "before it were written")
        nbytes = source.numel() * source.element_size()
        copied += nbytes
        again = False
        if id(target) in plan.tied:
            # the same bytes as the source already copied in, while that one lives (so
            # that no other tensor can have taken its address): nothing to copy
            origin = (source.data_ptr(), source.shape, source.stride(), source.dtype,
                      source.device)
            earlier = written.get(id(target))
            if earlier is not None and earlier[0]() is not None and earlier[1] == origin:
                continue
            again = earlier is not None  # another source: copied after, so it wins
            written[id(target)] = (weakref.ref(source), origin)
        if (again or nbytes >= ALONE_BYTES or source.device != target.device
                or not (source.is_contiguous() and target.is_contiguous())):
            alone.append((target, source))  # in order, after the groups
            continue
        group = together.setdefault((target.dtype, source.dtype, target.device), ([], []))
        group[0].append(target)
        group[1].append(source)
    for targets, sources in together.values():
        if len(targets) == 1:
            targets[0].copy_(sources[0])
        else:
            torch._foreach_copy_(targets, sources)
    for target, source in alone:
        target.copy_(source)
    return copied


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

