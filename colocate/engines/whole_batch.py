"""The torch generator's whole batches: rows left-padded into one batch that decodes until
every row has ended (or a preemption), on a transformers `DynamicCache` that lives for the
batch.

A row may start from keys and values kept for its session (`BatchRow.cached`, its first
`reuse` tokens): those are copied into the batch's cache, and only the rest is prefilled.
The caller gets each row's completion, the batch's cache and the cache's columns holding
each row's computed tokens, from which it keeps a session's keys and values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from colocate.engines.draw import draw
from colocate.engines.kv_sessions import BatchRow, prefilled_cache
from colocate.engines.sampling import Completion, SamplingParams


def decode_batch(model: torch.nn.Module, rows: Sequence[BatchRow], params: SamplingParams,
                 rng: torch.Generator, stop: Callable[[], bool] | None
                 ) -> tuple[list[Completion], object, list[torch.Tensor | None]]:
    """A completion of each row, of at most its budget's tokens (`versions` left empty),
    unfinished where `stop` said so first; the batch's cache, and per row the cache's
    columns that hold its computed tokens (None: not computed, the call was stopped first).

    Columns: each row's reused prefix right-aligned in the first `width` (the longest
    reused), its new tokens right-aligned in the next `span`, then one a decoding step; the
    mask leaves out the gaps, and positions count the unmasked columns."""
    if stop is not None and stop():
        return [Completion([], finished=False) for _ in rows], None, [None] * len(rows)
    from transformers import DynamicCache

    device = next(model.parameters()).device
    news = [row.tokens[row.reuse:] for row in rows]
    b, width, span = len(rows), max(row.reuse for row in rows), max(len(n) for n in news)
    steps = max(row.budget for row in rows)
    tokens = torch.zeros(b, span, dtype=torch.long, device=device)
    mask = torch.zeros(b, width + span + steps, dtype=torch.long, device=device)
    for i, (row, new) in enumerate(zip(rows, news, strict=True)):  # left padding
        tokens[i, span - len(new):] = torch.tensor(new, device=device)
        mask[i, width - row.reuse:width] = 1
        mask[i, width + span - len(new):width + span] = 1
    start = width + span
    positions = (mask[:, :start].cumsum(-1) - 1).clamp(min=0)[:, width:]
    cache = DynamicCache(config=model.config)
    if width:
        prefilled_cache(cache, [row.cached for row in rows], [row.reuse for row in rows], width)
    for row in rows:
        row.cached = None  # copied: the session cache may let it go (and its memory)
    logits = next_logits(model, tokens, mask[:, :start], positions, cache)
    position = positions[:, -1:]
    stops = torch.tensor(params.stop_token_ids, dtype=torch.long, device=device)
    budget = torch.tensor([row.budget for row in rows], dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    sampled, logprobs = [], []
    preempted = False
    for step in range(steps):
        token, logprob = draw(logits, params, rng)
        sampled.append(token)
        logprobs.append(logprob)
        done |= torch.isin(token, stops) | (budget <= step + 1)
        if done.all() or step == steps - 1:
            break
        if stop is not None and stop():
            preempted = True
            break
        mask[:, start + step] = 1
        position = position + 1
        logits = next_logits(model, token[:, None], mask[:, :start + step + 1], position, cache)
    completions = _completions(torch.stack(sampled, 1), torch.stack(logprobs, 1),
                               [row.budget for row in rows], params, preempted)
    columns = [mask[i, :start].nonzero()[:, 0] for i in range(b)]
    columns = [torch.cat([cols, torch.arange(start, start + max(0, len(c.tokens) - 1),
                                             device=device)])
               for cols, c in zip(columns, completions, strict=True)]
    return completions, cache, columns


def next_logits(model: torch.nn.Module, tokens: torch.Tensor, mask: torch.Tensor,
                positions: torch.Tensor, cache) -> torch.Tensor:
    """The next-token logits [B, V] after `tokens`, their keys and values added to `cache`;
    `mask` covers everything attended so far."""
    out = model(input_ids=tokens, attention_mask=mask, position_ids=positions,
                past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].float()


def _completions(tokens: torch.Tensor, logprobs: torch.Tensor, budgets: Sequence[int],
                 params: SamplingParams, preempted: bool) -> list[Completion]:
    """Each row cut after its first stop token or at its budget; after a preemption, a row
    that reached neither is unfinished."""
    out = []
    stops = set(params.stop_token_ids)
    for row_tokens, row_logprobs, budget in zip(tokens.tolist(), logprobs.tolist(), budgets,
                                                strict=True):
        row_tokens, row_logprobs = row_tokens[:budget], row_logprobs[:budget]
        end = next((i + 1 for i, t in enumerate(row_tokens) if t in stops), None)
        cut = end or len(row_tokens)
        finished = end is not None or cut == budget or not preempted
        out.append(Completion(row_tokens[:cut], row_logprobs[:cut], stopped=end is not None,
                              finished=finished))
    return out
