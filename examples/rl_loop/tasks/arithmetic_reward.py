"""Reward functions for `arithmetic.py`'s problems, written the TRL way: each gets the
batch's prompts and completions and, as keyword arguments, the data's other columns (here
`answer`), and returns one float (or None: does not apply) per completion.

    reward.funcs=[examples/rl_loop/tasks/arithmetic_reward.py:correct,
                  examples/rl_loop/tasks/arithmetic_reward.py:is_number]
"""

from __future__ import annotations


def correct(completions: list[str], answer: list[str], **kwargs: object) -> list[float]:
    """Partial credit: the answer's characters the completion has in place, divided by the
    longer of the two; 1.0 for the exact answer only."""
    scores = []
    for completion, target in zip(completions, answer, strict=True):
        right = sum(a == b for a, b in zip(completion, target, strict=False))
        scores.append(right / max(len(target), len(completion), 1))
    return scores


def is_number(completions: list[str], **kwargs: object) -> list[float]:
    """1.0 for a completion that is a number of at most two digits (what every answer is),
    else 0.0: a format reward."""
    return [1.0 if c.isdigit() and len(c) <= 2 else 0.0 for c in completions]
