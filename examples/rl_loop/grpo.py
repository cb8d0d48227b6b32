"""GRPO's math as pure functions over tensors: group-relative advantages, per-token
log-probabilities of completions, and the clipped policy-gradient loss with an optional KL
penalty to a reference policy. No model, no sampling, no Monarch: the loop calls these.

Shapes: B sequences (prompts x group_size, each prompt's group contiguous), T token
positions. A batch is right-padded: `input_ids[b, t]` predicts `targets[b, t]`, and `mask[b, t]`
is 1 where that target is a completion token (the stop token included), 0 on the prompt and
on padding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSS_TYPES = ("grpo", "dapo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")


@dataclass(frozen=True)
class GRPOConfig:
    """GRPO's knobs, validated here, once, named as TRL names them (`epsilon`, `beta`,
    `loss_type`, `scale_rewards`...). The defaults were measured on the toy task of
    `examples.rl_loop.task` with the loop's default policy (a random 2-layer, 64-wide
    transformers Llama): held-out reward from 0.06 to 0.67 in 150 steps and 0.87 in 300
    (seed 0). With the project's earlier Llama, lr 3e-3 stalled near 0.45 on some seeds and
    1e-2 collapsed."""

    group_size: int = 4  # samples per prompt; advantages are relative within a group
    prompts_per_step: int = 32
    temperature: float = 1.0  # for sampling and for the log-probabilities of the loss
    epsilon: float = 0.2  # PPO ratio clip: [1 - epsilon, 1 + epsilon_high]
    epsilon_high: float | None = None  # DAPO's clip-higher; None: epsilon
    beta: float = 0.0  # weight of the k3 KL to the reference policy; 0 needs no reference
    # how the per-token losses become one number: "dapo" (today's default) is the mean over
    # every completion token of the batch; "grpo" the mean over each sequence's tokens, then
    # over sequences; "dr_grpo" the sum over tokens / (sequences x max_completion_length)
    loss_type: str = "dapo"
    scale_rewards: str = "group"  # divide advantages by the group's std, the batch's, or not
    max_completion_length: int | None = None  # new tokens per completion; None: the task's
    mask_truncated: bool = False  # completions cut at the length limit left out of the loss
    updates_per_batch: int = 2  # optimizer steps on one batch of rollouts (GRPO's mu)
    lr: float = 1e-3
    max_grad_norm: float = 1.0
    eps: float = 1e-6  # added to the std the advantages are divided by
    # DAPO's dynamic sampling: groups whose rewards are all equal (no advantage) are dropped
    # and more prompts generated until prompts_per_step groups are left, in at most
    # max_gen_batches rounds of prompts_per_step prompts (`rollouts.Rollouts.dynamic`)
    dynamic_sampling: bool = False
    max_gen_batches: int = 3  # most rounds a step draws; short of groups, it trains on fewer

    def __post_init__(self) -> None:
        if not 0 < self.epsilon < 1:
            raise ValueError(f"GRPOConfig.epsilon={self.epsilon}: must be in (0, 1)")
        if self.beta < 0:
            raise ValueError(f"GRPOConfig.beta={self.beta}: must be >= 0")
        if self.group_size < 2:
            raise ValueError(f"GRPOConfig.group_size={self.group_size}: must be >= 2 "
                             "(a group of one has no relative advantage)")
        for name in ("prompts_per_step", "updates_per_batch", "max_gen_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"GRPOConfig.{name}={getattr(self, name)}: must be >= 1")
        for name in ("temperature", "lr", "max_grad_norm", "eps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"GRPOConfig.{name}={getattr(self, name)}: must be > 0")
        if self.epsilon_high is not None and not self.epsilon_high >= self.epsilon:
            raise ValueError(f"GRPOConfig.epsilon_high={self.epsilon_high}: must be >= "
                             f"epsilon ({self.epsilon}); DAPO's clip-higher raises the top")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"GRPOConfig.loss_type={self.loss_type!r}: use one of "
                             f"{LOSS_TYPES}")
        if self.scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"GRPOConfig.scale_rewards={self.scale_rewards!r}: use one of "
                             f"{SCALE_REWARDS}")
        if self.max_completion_length is not None and self.max_completion_length < 1:
            raise ValueError(f"GRPOConfig.max_completion_length={self.max_completion_length}"
                             ": must be >= 1")

    @property
    def clip_high(self) -> float:
        """The ratio's upper clip: 1 + (epsilon_high, or epsilon)."""
        return 1 + (self.epsilon if self.epsilon_high is None else self.epsilon_high)


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6, *,
                     scale_rewards: str = "group",
                     valid: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sequence advantages [B] from rewards [B] laid out group by group: each reward minus
    its group's mean, divided (`scale_rewards`, as TRL) by its group's std + eps ("group"),
    by the whole batch's std + eps ("batch"), or not at all ("none"); stds are the unbiased
    ones, as in TRL. A group whose rewards are all equal gets zeros.

    `valid` [B] (bool) marks the sequences that have a reward: the others (every reward
    function skipped them, or their scoring failed) are left out of the means and stds and
    get advantage 0."""
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)}: expected [B] with B a "
                         f"multiple of group_size={group_size}")
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r}: use one of {SCALE_REWARDS}")
    if valid is not None and not bool(valid.all()):
        return _partial_advantages(rewards, group_size, scale_rewards, eps, valid)
    groups = rewards.float().view(-1, group_size)
    centered = groups - groups.mean(dim=1, keepdim=True)
    if scale_rewards == "group":
        centered = centered / (groups.std(dim=1, keepdim=True) + eps)
    elif scale_rewards == "batch":
        centered = centered / (rewards.float().std() + eps)
    return centered.view(-1)


def _partial_advantages(rewards: torch.Tensor, group_size: int, scale_rewards: str,
                        eps: float, valid: torch.Tensor) -> torch.Tensor:
    """`group_advantages` where only the `valid` sequences count (a separate path: with every
    sequence valid, the plain one gives the loop's advantages bit for bit as before)."""
    keep = valid.view(-1, group_size).float()
    groups = torch.where(valid, rewards.float(), 0.0).view(-1, group_size)
    count = keep.sum(dim=1, keepdim=True)
    mean = groups.sum(dim=1, keepdim=True) / count.clamp(min=1)
    centered = (groups - mean) * keep
    if scale_rewards == "group":  # unbiased; a group with fewer than 2 rewards has std 0
        var = (centered**2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)
        centered = centered / torch.where(count > 1, var.sqrt() + eps, 1.0)
    elif scale_rewards == "batch":
        kept = rewards.float()[valid]
        std = kept.std() if kept.numel() > 1 else torch.zeros(())
        centered = centered / (std + eps)
    return centered.view(-1)


def pack_batch(prompts: list[list[int]], completions: list[list[int]],
               pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, targets, mask), each [B, T] with T the longest
    prompt + completion minus one, from token lists (prompts start with the bos token;
    completions end with the stop token when one ended them)."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    if any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token (the bos token)")
    width = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True)) - 1
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    targets = torch.full_like(input_ids, pad_id)
    mask = torch.zeros(len(prompts), width)
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        sequence = torch.tensor(prompt + completion, dtype=torch.long)
        input_ids[row, : len(sequence) - 1] = sequence[:-1]
        targets[row, : len(sequence) - 1] = sequence[1:]
        mask[row, len(prompt) - 1 : len(sequence) - 1] = 1.0
    return input_ids, targets, mask


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """log p(targets[b, t]) under softmax(logits / temperature), [B, T], zero where the mask
    is 0. `logits` is [B, T, V]: the model's output for the batch's input_ids."""
    logp = F.log_softmax(logits.float() / temperature, dim=-1)
    picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked * mask


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy (Schulman's
    k3, veRL's "low_var_kl", as in the GRPO paper and TRL): exp(ref - logp) - (ref - logp)
    - 1, always >= 0. Clamped as veRL (`core_algos.kl_penalty`) and OpenRLHF
    (`compute_approx_kl`) clamp it: the log-ratio to [-20, 20] and the estimate to at most
    10 a token, so one token far from the reference cannot overflow exp() (on a GPU, a
    ~0.5 B model of wide initial logits read 1.2e14 at its first step and ended in NaN
    weights, bench/RESULTS.md "Second GPU session")."""
    delta = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return (torch.exp(delta) - delta - 1).clamp(max=10.0)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str,
              max_completion_length: int | None = None) -> torch.Tensor:
    """Per-token values [B, T] to one number, `loss_type` as TRL: "dapo" the mean over every
    masked token of the batch, "grpo" the mean over each sequence's tokens then over the
    sequences, "dr_grpo" the sum over tokens divided by B x max_completion_length (a
    constant: long and short completions weigh by their length, without a length bias)."""
    if loss_type == "dapo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "grpo":
        per_sequence = (per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        return per_sequence.mean()
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length (its divisor)")
        return (per_token * mask).sum() / (per_token.shape[0] * max_completion_length)
    raise ValueError(f"loss_type={loss_type!r}: use one of {LOSS_TYPES}")


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, cfg: GRPOConfig,
              ref_logprobs: torch.Tensor | None = None, *,
              prox_logprobs: torch.Tensor | None = None, stale: torch.Tensor | None = None,
              is_cap: float = 2.0) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped policy-gradient loss (ratio clipped to [1 - epsilon, 1 + epsilon_high]),
    aggregated by `cfg.loss_type` (the default "dapo": every completion token weighs the
    same), plus beta x the k3 KL to the reference policy, aggregated the same way.

    `logprobs` [B, T] carries the gradient; `old_logprobs` [B, T] are the sampling policy's;
    `advantages` [B] are one per sequence. Returns the loss and its statistics: the
    policy-gradient term, the KL (0 without a reference), the fraction of tokens whose ratio
    was clipped (in all, below and above), and the mean ratio.

    With `prox_logprobs` and `stale` [B, T] (partial rollouts: tokens sampled by an older
    policy version than the trainer's), the stale tokens take AReaL's decoupled objective,
    truncated as veRL's TIS: the PPO ratio is taken to the proximal policy (the trainer's
    weights at the step's start, `prox_logprobs`), clipped as usual, and weighted by the
    importance ratio proximal / behaviour (`old_logprobs`, the version that sampled the
    token), truncated at `is_cap` (TIS's C). Token-level, since one sample's tokens come
    from several versions; decoupled, since a ratio to the behaviour policy of a few
    versions ago is far from 1 and PPO's clip would take most of those tokens out of the
    gradient, where the trust region belongs around the current policy; truncated (not
    clipped both ways, not dropped), to bound the weight's variance and keep every token.
    Tokens sampled by the current version keep the plain loss: with no stale token it is
    exactly the sync loop's."""
    if cfg.beta > 0 and ref_logprobs is None:
        raise ValueError(f"beta={cfg.beta} needs ref_logprobs")
    tokens = mask.sum().clamp(min=1.0)
    weight = None
    if prox_logprobs is not None and stale is not None:
        older = (stale > 0) & (mask > 0)
        prox, behaviour = prox_logprobs.detach(), old_logprobs.detach()
        weight = torch.where(older, torch.exp((prox - behaviour).clamp(max=math.log(is_cap))),
                             1.0)
        old_logprobs = torch.where(older, prox, behaviour)
    ratio = torch.exp(logprobs - old_logprobs.detach())
    adv = advantages.detach().unsqueeze(-1)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - cfg.epsilon, cfg.clip_high) * adv
    surrogate = torch.minimum(unclipped, clipped)
    if weight is not None:
        surrogate = surrogate * weight
    pg = aggregate(-surrogate, mask, cfg.loss_type, cfg.max_completion_length)
    loss = pg
    kl = torch.zeros(())
    if ref_logprobs is not None:
        kl = aggregate(kl_k3(logprobs, ref_logprobs.detach()), mask, cfg.loss_type,
                       cfg.max_completion_length)
        loss = loss + cfg.beta * kl
    with torch.no_grad():
        was_clipped = (clipped < unclipped).float() * mask
        low = was_clipped * (ratio < 1 - cfg.epsilon)
        mean_ratio = (ratio * mask).sum() / tokens
    stats = {"pg_loss": pg.item(), "kl": kl.item(), "clip_frac": (was_clipped.sum() /
             tokens).item(), "clip_frac_low": (low.sum() / tokens).item(),
             "clip_frac_high": ((was_clipped - low).sum() / tokens).item(),
             "ratio": mean_ratio.item()}
    if weight is not None:
        count = older.sum().clamp(min=1)
        stats["is_weight"] = ((weight * older).sum() / count).item()
        stats["is_truncated_frac"] = ((weight >= is_cap - 1e-6) & older).sum().item() / \
            count.item()
    return loss, stats


def supervised_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    input_ids: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor
                    ) -> float:
    """One teacher-forced step on `pack_batch`'s tensors: the mean cross-entropy over the
    tokens `mask` keeps (a warm start's, before RL); returns it."""
    logits = model(input_ids=input_ids).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                             reduction="none")
    loss = (loss * mask.flatten()).sum() / mask.sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()
