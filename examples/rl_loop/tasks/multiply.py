"""Write a task the model cannot do without its tool: products of two 3-digit numbers.

    python examples/rl_loop/tasks/multiply.py runs/multiply/data

writes train.jsonl and eval.jsonl there: one problem a row, `{"prompt": "123*456=",
"answer": "56088"}`. The eval problems are held out: none of them is in train.jsonl. A
tiny model cannot learn 3-digit multiplication from a few thousand samples, but it can
learn to call the calculator (`multiply_tools.py:calculator`, in the plain form
`calc(123*456)`, `examples.rl_loop.tool_calls`) and copy its answer;
`multiply_reward.py:correct` scores the final answer of the conversation.

    tools.funcs=[examples/rl_loop/tasks/multiply_tools.py:calculator]
    reward.funcs=[examples/rl_loop/tasks/multiply_reward.py:correct]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def problems(n: int, seed: int) -> list[dict[str, str]]:
    """`n` distinct problems a*b with 100 <= a, b <= 999, drawn by `seed`."""
    rng = random.Random(seed)
    found: dict[str, str] = {}
    while len(found) < n:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        found.setdefault(f"{a}*{b}=", str(a * b))
    return [{"prompt": prompt, "answer": answer} for prompt, answer in found.items()]


def write(out: Path, train_size: int = 2000, eval_size: int = 64, seed: int = 0
          ) -> tuple[Path, Path]:
    """train.jsonl and eval.jsonl under `out`: `eval_size` problems held out, the rest
    (`train_size`) for training. Returns their paths."""
    rows = problems(train_size + eval_size, seed)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.jsonl", out / "eval.jsonl"
    for path, part in zip(paths, (rows[eval_size:], rows[:eval_size]), strict=True):
        path.write_text("".join(json.dumps(row) + "\n" for row in part))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="directory for train.jsonl and eval.jsonl")
    parser.add_argument("--train-size", type=int, default=2000)
    parser.add_argument("--eval-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for path in write(args.out, args.train_size, args.eval_size, args.seed):
        print(f"wrote {path} ({len(path.read_text().splitlines())} problems)")


if __name__ == "__main__":
    main()
