"""Drawing the next token from a model's logits as `SamplingParams` ask (temperature, top-p,
greedy), with its log-probability under the distribution it was drawn from. Shared by the
torch generator's whole batches and its continuous decode loop (`decoding`)."""

from __future__ import annotations

import torch

from colocate.engines.sampling import SamplingParams


def draw(logits: torch.Tensor, params: SamplingParams, rng: torch.Generator
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """A token per row of `logits` [B, V] and its log-probability under the sampling
    distribution, drawn with `rng`."""
    if params.greedy:
        token = logits.argmax(-1)
        return token, logits.log_softmax(-1).gather(-1, token[:, None])[:, 0]
    logprobs = (logits / params.temperature).log_softmax(-1)
    if params.top_p < 1:
        sorted_lp, order = logprobs.sort(-1, descending=True)
        before = sorted_lp.exp().cumsum(-1) - sorted_lp.exp()  # mass above each token
        sorted_lp = sorted_lp.masked_fill(before >= params.top_p, float("-inf"))
        logprobs = torch.full_like(logprobs, float("-inf")).scatter(-1, order, sorted_lp)
        logprobs = logprobs.log_softmax(-1)
    token = torch.multinomial(logprobs.exp(), 1, generator=rng)[:, 0]
    return token, logprobs.gather(-1, token[:, None])[:, 0]
