"""Weights into a model's own tensors, in place: `copy_weights` writes a stream of
(Hugging Face name, tensor) pairs into a model's existing tensors (no new memory,
addresses unchanged), after checking every name and shape (`check_weights`: all of them,
or nothing). Where each name is in the model is planned at the first sync and kept while
the model's tensors stay (`CopyPlan`), and a bucket's small tensors are copied by one
`torch._foreach_copy_`, so a sync's host time is not one copy call per tensor (figures from
`bench/engines.py`, on CPU only: bench/RESULTS.md, "Pinned at adoption, the planned
in-place sync"; this planned sync has not run on a GPU).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch import nn

from colocate.engines.weights import WeightStream, as_stream


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
