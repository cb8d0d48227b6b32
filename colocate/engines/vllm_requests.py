"""A call's rows as vLLM requests, and vLLM's outputs as `Completion`s: request `i` of a
call seeded with seed + i, every token's log-probability as sampled, and the prompt's tokens
vLLM found in its prefix cache."""

from __future__ import annotations

import itertools
from typing import Any

import vllm

from colocate.engines.sampling import Completion, PrefixCounts, SamplingParams

_REQUESTS = itertools.count()  # request ids, unique in the process


def request_id() -> str:
    """A new request id, unique in this process."""
    return f"colocate-{next(_REQUESTS)}"


def vllm_params(params: SamplingParams, index: int, budget: int) -> vllm.SamplingParams:
    return vllm.SamplingParams(
        max_tokens=budget, temperature=params.temperature, top_p=params.top_p,
        stop_token_ids=list(params.stop_token_ids), ignore_eos=True, logprobs=0,
        seed=None if params.seed is None else params.seed + index, detokenize=False,
    )


def completion_of(request: Any | None) -> Completion:
    """A request's latest output (`vllm.RequestOutput`; None: it had none, aborted before
    its first step), with its prompt's cached tokens as `prefix.reused` (to be counted
    against its session's record); unfinished unless vLLM finished it."""
    if request is None:
        return Completion([], finished=False)
    out = request.outputs[0]
    tokens = list(out.token_ids)
    logprobs = [entry[token].logprob for token, entry in zip(tokens, out.logprobs, strict=True)]
    cached = PrefixCounts(len(request.prompt_token_ids or ()), request.num_cached_tokens or 0)
    return Completion(tokens, logprobs, stopped=out.finish_reason == "stop",
                      finished=request.finished, prefix=cached)
