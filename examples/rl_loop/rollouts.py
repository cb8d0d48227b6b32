"""From rollouts to a training batch, and the loss the trainer runs on it.

`make_batch` packs prompts and sampled completions (with the generator's log-probs and the
group-relative advantages) into tensors; `GRPOLoss` is what `TrainerActor.train_step` calls
on each data-parallel rank, on that rank's share of the rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from colocate.engines.sampling import Completion
from examples.rl_loop.grpo import GRPOConfig, grpo_loss, pack_batch, token_logprobs


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


@dataclass(frozen=True)
class GRPOLoss:
    """loss_fn(module, batch) for `TrainerActor.train_step`: GRPO's clipped loss on this
    rank's rows (rank r of w takes rows r, r + w, ...)."""

    config: GRPOConfig

    def __call__(self, module: torch.nn.Module, batch: dict[str, torch.Tensor]
                 ) -> tuple[torch.Tensor, dict[str, float]]:
        if dist.is_initialized():
            rows = slice(dist.get_rank(), None, dist.get_world_size())
            batch = {key: value[rows] for key, value in batch.items()}
        logits = module(input_ids=batch["input_ids"],
                        attention_mask=batch["valid"].long()).logits
        logprobs = token_logprobs(logits, batch["targets"], batch["mask"],
                                  self.config.temperature)
        return grpo_loss(logprobs, batch["old_logprobs"], batch["advantages"], batch["mask"],
                         self.config)
