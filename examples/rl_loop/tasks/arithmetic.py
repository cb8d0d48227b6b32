"""Write a small arithmetic dataset, as a user of the RL loop would prepare their own task.

    python examples/rl_loop/tasks/arithmetic.py runs/arithmetic/data

writes train.jsonl and eval.jsonl there: one problem a row, `{"prompt": "7+5=", "answer":
"12"}` (single-digit sums and differences that stay >= 0). The eval problems are held out:
none of them is in train.jsonl. `arithmetic_reward.py` beside this file scores the
completions; the README's "Your own task" trains on it.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def problems() -> list[dict[str, str]]:
    """Every problem of the task, in a fixed order."""
    found = []
    for a in range(10):
        for b in range(10):
            found.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
            if a >= b:
                found.append({"prompt": f"{a}-{b}=", "answer": str(a - b)})
    return found


def write(out: Path, eval_size: int = 32, seed: int = 0) -> tuple[Path, Path]:
    """train.jsonl and eval.jsonl under `out`: `eval_size` problems held out, the rest for
    training. Returns their paths."""
    rows = problems()
    random.Random(seed).shuffle(rows)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.jsonl", out / "eval.jsonl"
    for path, part in zip(paths, (rows[eval_size:], rows[:eval_size]), strict=True):
        path.write_text("".join(json.dumps(row) + "\n" for row in part))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="directory for train.jsonl and eval.jsonl")
    parser.add_argument("--eval-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for path in write(args.out, args.eval_size, args.seed):
        print(f"wrote {path} ({len(path.read_text().splitlines())} problems)")


if __name__ == "__main__":
    main()
