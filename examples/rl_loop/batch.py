"""From rollouts to a training batch, and the loss the trainer runs on it.

`make_batch` packs prompts and sampled completions (with the generator's log-probs and the
group-relative advantages) into tensors; `scored_batch` makes those advantages from a
step's rewards first, with the step's reward and completion statistics; `GRPOLoss` is what
`TrainerActor.train_step` calls on each data-parallel rank, on that rank's share of the
rows; `ReferenceLogprobs` is what `ReferenceActor.forward` calls the same way, for the
reference log-probabilities of the KL term (`grpo.beta > 0`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from colocate.engines.sampling import Completion
from examples.rl_loop.grpo import (
    GRPOConfig,
    group_advantages,
    grpo_loss,
    pack_batch,
    token_logprobs,
)
from examples.rl_loop.sources import Scored


def make_batch(prompts: list[list[int]], completions: list[Completion],
               advantages: torch.Tensor, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids/targets/mask/valid, the sampling policy's log-probs at the
    completion tokens, and one advantage per row."""
    tokens = [c.tokens for c in completions]
    input_ids, targets, mask = pack_batch(prompts, tokens, pad_id)
    old = torch.zeros_like(mask)
    valid = torch.zeros_like(mask, dtype=torch.bool)
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        start, end = len(prompt) - 1, len(prompt) - 1 + len(completion.tokens)
        old[row, start:end] = torch.tensor(completion.logprobs)
        valid[row, :end] = True
    return {"input_ids": input_ids, "targets": targets, "mask": mask, "valid": valid,
            "old_logprobs": old, "advantages": advantages}


def scored_batch(tokens: list[list[int]], completions: list[Completion], result: Scored,
                 grpo: GRPOConfig, pad_id: int
                 ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The training batch from a step's scored rollouts, and the step's reward and
    completion statistics. Samples without a reward get advantage 0; those dropped
    (reward.on_error=skip) and, with grpo.mask_truncated, those cut at the length limit
    are left out of the loss (their mask is zeroed)."""
    values = result.values
    rewards = torch.tensor([0.0 if v is None else v for v in values])
    valid = None
    if any(v is None for v in values):
        valid = torch.tensor([v is not None for v in values])
    advantages = group_advantages(rewards, grpo.group_size, eps=grpo.eps,
                                  scale_rewards=grpo.scale_rewards, valid=valid)
    batch = make_batch(tokens, completions, advantages, pad_id)
    truncated = [not c.stopped for c in completions]
    left_out = set(result.dropped)
    if grpo.mask_truncated:
        left_out |= {i for i, cut in enumerate(truncated) if cut}
    for i in left_out:
        batch["mask"][i] = 0.0
    lengths = [len(c.tokens) for c in completions]
    scored = [v for v in values if v is not None]
    mean = rewards.mean().item() if valid is None else (
        sum(scored) / len(scored) if scored else None)
    stats = {"reward": mean, **result.metrics,
             "completion_len_mean": sum(lengths) / len(lengths),
             "completion_len_min": min(lengths), "completion_len_max": max(lengths),
             "truncated_share": sum(truncated) / len(truncated)}
    return batch, stats


@dataclass(frozen=True)
class ReferenceLogprobs:
    """fn(model, batch) for `ReferenceActor.forward`: the reference policy's log-probs of the
    batch's targets [B, T]. Each rank computes its rows (as `GRPOLoss` splits them), and
    rank 0 answers the whole batch's, gathered from every rank."""

    temperature: float

    def __call__(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]
                 ) -> torch.Tensor:
        rank, world = _rank_and_world()
        rows = slice(rank, None, world)
        logits = model(input_ids=batch["input_ids"][rows],
                       attention_mask=batch["valid"][rows].long()).logits
        mine = token_logprobs(logits, batch["targets"][rows], batch["mask"][rows],
                              self.temperature)
        return mine if world == 1 else _gather_rows(mine, batch["input_ids"].shape[0])


def _rank_and_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather_rows(mine: torch.Tensor, rows: int) -> torch.Tensor:
    """Every rank's rows (rank r of w holds rows r, r + w, ...) put back in order: padded to
    the same count for one all-gather."""
    world = dist.get_world_size()
    most = -(-rows // world)
    padded = mine.new_zeros((most, *mine.shape[1:]))
    padded[: mine.shape[0]] = mine
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    full = mine.new_empty((rows, *mine.shape[1:]))
    for rank, part in enumerate(parts):
        count = len(range(rank, rows, world))
        full[rank::world] = part[:count]
    return full


@dataclass(frozen=True)
class GRPOLoss:
    """loss_fn(module, batch) for `TrainerActor.train_step`: GRPO's clipped loss on this
    rank's rows (rank r of w takes rows r, r + w, ...), with the KL to the batch's
    "ref_logprobs" when it has them."""

    config: GRPOConfig
    # partial rollouts, a batch with tokens of older versions ("behind" > 0): the truncation
    # of their importance weight, and which of the step's updates this is (the first keeps
    # the proximal log-probabilities, the trainer's at the step's start, for the others)
    is_cap: float | None = None
    update: int = 0
    updates: int = 1

    def __call__(self, module: torch.nn.Module, batch: dict[str, torch.Tensor]
                 ) -> tuple[torch.Tensor, dict[str, float]]:
        if dist.is_initialized():
            rows = slice(dist.get_rank(), None, dist.get_world_size())
            batch = {key: value[rows] for key, value in batch.items()}
        logits = module(input_ids=batch["input_ids"],
                        attention_mask=batch["valid"].long()).logits
        logprobs = token_logprobs(logits, batch["targets"], batch["mask"],
                                  self.config.temperature)
        if self.is_cap is None or "behind" not in batch:
            return grpo_loss(logprobs, batch["old_logprobs"], batch["advantages"],
                             batch["mask"], self.config, batch.get("ref_logprobs"))
        if self.update == 0:  # before any update of this batch: the proximal policy's
            prox = logprobs.detach()
            if self.updates > 1:
                module.__dict__[PROX] = prox
        else:
            prox = module.__dict__[PROX]
            if self.update == self.updates - 1:  # the last update: they go with this step
                del module.__dict__[PROX]
        return grpo_loss(logprobs, batch["old_logprobs"], batch["advantages"], batch["mask"],
                         self.config, batch.get("ref_logprobs"), prox_logprobs=prox,
                         stale=batch["behind"], is_cap=self.is_cap)


PROX = "_rl_loop_proximal_logprobs"  # where the first update leaves them on the module


def losses(grpo: GRPOConfig, updates: int, is_cap: float | None) -> list[GRPOLoss]:
    """The loss of each of a step's `updates`: the plain one, or (`is_cap`, a batch with
    older tokens) the first keeping the proximal log-probabilities, the last dropping
    them."""
    if is_cap is None:
        return [GRPOLoss(grpo)] * updates
    return [GRPOLoss(grpo, is_cap, u, updates) for u in range(updates)]


def behind(prompts: list[list[int]], completions: list[Completion], version: int,
           like: torch.Tensor) -> torch.Tensor:
    """[B, T] as `like` (the batch's mask): at each completion token, how many policy
    versions older than `version` the one that sampled it is."""
    out = torch.zeros_like(like)
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        start = len(prompt) - 1
        out[row, start:start + len(completion.versions)] = torch.tensor(
            [version - v for v in completion.versions], dtype=out.dtype)
    return out
