"""A task played against a stateful environment: guess the secret number, told "higher" or
"lower" after each guess.

    python examples/rl_loop/tasks/guess.py runs/guess/data

writes train.jsonl and eval.jsonl there: one game a row, `{"prompt": "guess 0-99: higher or
lower", "secret": "37"}`. `Guess` (`env.cls`) opens each episode with the row's prompt,
keeps the secret, and answers each turn of the model: "higher", "lower" ("guess" for a turn
without a number), or nothing and done when the guess is right; `closeness`
(`reward.funcs`) scores the conversation's last guess. The secret is never shown: what the
model can learn is a way of searching, so the eval rows are the same kind of game (their
secrets drawn apart, not held out).

    env.cls=examples/rl_loop/tasks/guess.py:Guess
    reward.funcs=[examples/rl_loop/tasks/guess.py:closeness]

The prompt holds every character the environment writes, so the tiny character model (whose
vocabulary is the data's characters) reads the observations too; in its plain form the
transcript is the guesses and the observations one after another, `50lower25higher37`.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path
from typing import Any

PROMPT = "guess 0-99: higher or lower"
HIGHEST = 99
_NUMBER = re.compile(r"\d+")


class Guess:
    """One game: the secret from the row, an observation after each guess."""

    def __init__(self) -> None:
        self.secret: int | None = None

    def reset(self, row: dict[str, Any]) -> list[dict[str, str]]:
        """The opening: the row's prompt, as the user's message; the secret kept."""
        self.secret = int(row["secret"])
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, assistant_message: dict[str, Any]) -> tuple[list[dict[str, str]], bool]:
        """The observation of a guess: higher or lower (a turn without a number: guess),
        or nothing and done for the secret."""
        guess = last_guess(assistant_message.get("content") or "")
        if guess is None:
            return [{"role": "user", "content": "guess"}], False
        if guess == self.secret:
            return [], True
        return [{"role": "user", "content": "higher" if guess < self.secret else "lower"}], False


def last_guess(text: str) -> int | None:
    """The last number in `text` (None: none)."""
    found = _NUMBER.findall(text)
    return int(found[-1]) if found else None


def closeness(completions: list[Any], secret: list[str], **kwargs: object) -> list[float]:
    """1 for the secret, less the further the conversation's last guess is from it (0: no
    guess). A completion is chat messages (the last assistant message's guess) or the plain
    transcript's text (its last number: the plain form's observations hold none)."""
    scores = []
    for completion, target in zip(completions, secret, strict=True):
        if isinstance(completion, list):
            said = [m.get("content") or "" for m in completion if m.get("role") == "assistant"]
            completion = said[-1] if said else ""
        guess = last_guess(completion)
        scores.append(0.0 if guess is None
                      else max(0.0, 1 - abs(guess - int(target)) / (HIGHEST + 1)))
    return scores


def overrides(data: Path) -> list[str]:
    """The task's config: its files, environment and reward, a turn a guess (two digits and
    the stop token), and room for the seven guesses a halving search needs."""
    here = Path(__file__).resolve()
    return [f"data.train_files={data / 'train.jsonl'}", f"data.eval_files={data / 'eval.jsonl'}",
            f"env.cls={here}:Guess", f"reward.funcs=[{here}:closeness]",
            "grpo.max_completion_length=3", "rollout.max_turns=7", "model.max_positions=96"]


def write(out: Path, train_size: int = 1000, eval_size: int = 32, seed: int = 0
          ) -> tuple[Path, Path]:
    """train.jsonl and eval.jsonl under `out`, secrets drawn by `seed`. Returns their
    paths."""
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.jsonl", out / "eval.jsonl"
    for path, size in zip(paths, (train_size, eval_size), strict=True):
        path.write_text("".join(
            json.dumps({"prompt": PROMPT, "secret": str(rng.randint(0, HIGHEST))}) + "\n"
            for _ in range(size)))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="directory for train.jsonl and eval.jsonl")
    parser.add_argument("--train-size", type=int, default=1000)
    parser.add_argument("--eval-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for path in write(args.out, args.train_size, args.eval_size, args.seed):
        print(f"wrote {path} ({len(path.read_text().splitlines())} games)")


if __name__ == "__main__":
    main()
