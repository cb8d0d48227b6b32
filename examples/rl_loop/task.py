"""The toy task: copy a short digit string. "312>" -> "312", then the eos token.

Copying is the task because a small random model learns it with GRPO on CPU in about a
minute, where reversal plateaus and two-digit addition does not move (the figures:
bench/RESULTS.md, "The toy task: why copying digits").

The reward is verifiable and gives partial credit: the answer positions the completion gets
right, divided by the longer of the answer and the completion, so a random policy already
gets a learnable signal, too long or too short completions lose credit, and the exact answer
alone scores 1.0. The held-out evaluation set is fixed by its seed and never sampled for
training. Prompts and completions are text: the loop encodes and decodes them with the
model's own tokenizer (the default model's is a character tokenizer over ALPHABET).

The long-tail variant (`--config examples/rl_loop/long_tail.yaml`: 1 to 24 digits, each
length k digits past the shortest weighted length_decay**k) has completions of 2 to 25
tokens, most of them short: a sync step's generation lasts as long as its longest sample,
which `rollout.mode=partial` (`partial.py`) does not wait for.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

DIGITS = "0123456789"
SEPARATOR = ">"  # ends every prompt
ALPHABET = DIGITS + SEPARATOR


@dataclass(frozen=True)
class TaskConfig:
    """The task's shape. Validated here, once."""

    min_digits: int = 2
    max_digits: int = 4
    eval_size: int = 64
    eval_seed: int = 1234
    # each string's length: 1.0 uniform in [min_digits, max_digits]; below 1, a long tail:
    # length min_digits + k with weight length_decay**k (the long-tail task, long_tail.yaml)
    length_decay: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"TaskConfig: need 1 <= min_digits ({self.min_digits}) <= "
                             f"max_digits ({self.max_digits})")
        if not 0 < self.length_decay <= 1:
            raise ValueError(f"TaskConfig.length_decay={self.length_decay}: must be in (0, 1]")
        distinct = sum(10**n for n in range(self.min_digits, self.max_digits + 1))
        if not 1 <= self.eval_size <= distinct // 2:
            raise ValueError(f"TaskConfig.eval_size={self.eval_size}: must be in "
                             f"[1, {distinct // 2}], half of the {distinct} distinct prompts, "
                             "so that training keeps prompts of its own")

    @property
    def max_new_tokens(self) -> int:
        """Room for the longest answer and its eos token."""
        return self.max_digits + 1


def _prompt(cfg: TaskConfig, rng: random.Random) -> str:
    if cfg.length_decay == 1.0:  # uniform: exactly the draws of before the long tail existed
        length = rng.randint(cfg.min_digits, cfg.max_digits)
    else:
        lengths = range(cfg.min_digits, cfg.max_digits + 1)
        length = rng.choices(lengths, [cfg.length_decay**k for k in range(len(lengths))])[0]
    return "".join(rng.choice(DIGITS) for _ in range(length)) + SEPARATOR


@functools.cache
def _eval_set(cfg: TaskConfig) -> tuple[str, ...]:
    rng, prompts = random.Random(cfg.eval_seed), {}  # a dict keeps the first-seen order
    while len(prompts) < cfg.eval_size:
        prompts[_prompt(cfg, rng)] = None
    return tuple(prompts)


def eval_prompts(cfg: TaskConfig) -> list[str]:
    """The held-out set: `eval_size` distinct prompts, the same for every run with this
    config."""
    return list(_eval_set(cfg))


def sample_prompts(cfg: TaskConfig, n: int, rng: random.Random) -> list[str]:
    """`n` training prompts (min..max digits, then ">"), none of them in the held-out set."""
    held_out = frozenset(_eval_set(cfg))
    prompts: list[str] = []
    while len(prompts) < n:
        prompt = _prompt(cfg, rng)
        if prompt not in held_out:
            prompts.append(prompt)
    return prompts


def answer(prompt: str) -> str:
    """The completion that earns 1.0: the prompt's digits."""
    digits = prompt.removesuffix(SEPARATOR)
    if digits == prompt or not digits:
        raise ValueError(f"prompt {prompt!r}: expected digits, then {SEPARATOR!r}")
    return digits


def reward(prompt: str, completion: str) -> float:
    """In [0, 1]: the positions where `completion` matches the answer, divided by the longer
    of the two lengths. 1.0 only for the exact answer; 0.0 for an empty completion."""
    target = answer(prompt)
    right = sum(a == b for a, b in zip(completion, target, strict=False))
    return right / max(len(target), len(completion))
