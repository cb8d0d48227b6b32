"""The toy task: reverse a short digit string. "312>" -> "213", then the eos token.

The reward is verifiable and gives partial credit, so a random policy already gets a
learnable signal: the fraction of answer positions that are right, minus a penalty for a
wrong length, clipped to [0, 1]. The held-out evaluation set is fixed by its seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

ALPHABET = "0123456789>"


@dataclass(frozen=True)
class TaskConfig:
    """The task's shape. Validated here, once."""

    min_digits: int = 2
    max_digits: int = 4
    eval_size: int = 64
    eval_seed: int = 1234
    length_penalty: float = 0.25  # per character too many or too few

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"TaskConfig: need 1 <= min_digits ({self.min_digits}) <= "
                             f"max_digits ({self.max_digits})")
        if self.eval_size < 1:
            raise ValueError(f"TaskConfig.eval_size={self.eval_size}: must be >= 1")

    @property
    def max_new_tokens(self) -> int:
        """Room for the longest answer and its eos token."""
        return self.max_digits + 1


def sample_prompts(cfg: TaskConfig, n: int, rng: random.Random) -> list[str]:
    """`n` prompts: digit strings of min..max digits, then ">"."""
    prompts = []
    for _ in range(n):
        length = rng.randint(cfg.min_digits, cfg.max_digits)
        prompts.append("".join(rng.choice("0123456789") for _ in range(length)) + ">")
    return prompts


def eval_prompts(cfg: TaskConfig) -> list[str]:
    """The held-out set: the same prompts for every run with this config."""
    return sample_prompts(cfg, cfg.eval_size, random.Random(cfg.eval_seed))


def answer(prompt: str) -> str:
    return prompt.removesuffix(">")[::-1]


def reward(prompt: str, completion: str) -> float:
    """1.0 for the exact reversal; otherwise the share of right positions, less the
    length penalty; never below 0."""
    target = answer(prompt)
    right = sum(a == b for a, b in zip(completion, target, strict=False))
    penalty = TaskConfig.length_penalty * abs(len(completion) - len(target))
    return max(0.0, right / len(target) - penalty)
