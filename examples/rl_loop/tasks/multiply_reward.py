"""The reward of `multiply.py`'s task: the final answer of the conversation, whatever the
turns before it (tool calls and their observations), against the `answer` column.

    reward.funcs=[examples/rl_loop/tasks/multiply_reward.py:correct]

A completion is chat messages (a chat prompt's; the final answer is the last assistant
message's text) or text (the plain form of `examples.rl_loop.tool_calls`: the final answer
is what follows the last observation, `calc(123*456)[56088]56088` -> `56088`).
"""

from __future__ import annotations

import re
from typing import Any

_CALLS = re.compile(r"<tool_call>.*?(</tool_call>|$)", re.DOTALL)


def final_answer(completion: str | list[dict[str, Any]]) -> str:
    """The conversation's last word: the last assistant message's text outside its tool
    calls, or the text after the last `]` of a plain transcript."""
    if isinstance(completion, list):
        said = [m for m in completion if m.get("role") == "assistant"]
        content = said[-1].get("content") if said else ""
        return _CALLS.sub("", content if isinstance(content, str) else "").strip()
    return completion.rpartition("]")[2].strip()


def correct(completions: list[Any], answer: list[str], **kwargs: object) -> list[float]:
    """Partial credit: the answer's digits the final answer has in place, divided by the
    longer of the two; 1.0 for the exact answer only."""
    scores = []
    for completion, target in zip(completions, answer, strict=True):
        said = final_answer(completion)
        right = sum(a == b for a, b in zip(said, target, strict=False))
        scores.append(right / max(len(target), len(said), 1))
    return scores
