"""A starting model for `multiply.py`'s task that knows the calculator, as an instruction-tuned
model knows its tools before RL, but seldom thinks of using it: the tiny model the loop
would build for the task, fitted by teacher forcing to two kinds of demonstration.

    python examples/rl_loop/tasks/multiply_warm.py runs/multiply/data runs/multiply/start

- A call: the problem's expression given to the calculator, the observation, and the
  observation copied as the answer: `123*456=` -> `c(123*456)[56088]56088` and the stop
  token (the observation's tokens are not trained on, as in a rollout).
- A guess: the answer written at once, as a tiny model guesses, by repeating the problem's
  first number: `123*456=` -> `123`.

Both kinds come in equal numbers, so the model learns the call and the copy as well as the
guess; but the first token, where it decides, is trained on a call only `DECIDE_SHARE` of
the time, so it calls about one time in six: greedy, it guesses (its held-out answers are
wrong), and sampled, it sometimes calls. RL has to teach it that calling pays.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch

from examples.rl_loop.config import load_config
from examples.rl_loop.grpo import pack_batch, supervised_step
from examples.rl_loop.runtime import model_dir
from examples.rl_loop.sources import make_source

TASKS = Path(__file__).resolve().parent


def task_overrides(data: Path) -> list[str]:
    """The task's config, as its RL run gives it (the model's characters come from it)."""
    return [f"data.train_files={data / 'train.jsonl'}", f"data.eval_files={data / 'eval.jsonl'}",
            f"reward.funcs=[{TASKS / 'multiply_reward.py'}:correct]",
            f"tools.funcs=[{TASKS / 'multiply_tools.py'}:calculator]",
            "grpo.max_completion_length=12", "model.max_positions=48"]


DECIDE_SHARE = 0.2  # of the calls whose first token (the decision to call) is trained


def demonstration(problem: str, answer: str, rng: random.Random
                  ) -> tuple[list[tuple[str, bool]], bool]:
    """One demonstration of `problem` (`123*456=`): its parts, each with whether it is
    trained on (the observation is not), and whether its first token is."""
    if rng.random() < 0.5:
        call = f"c({problem.removesuffix('=')})"
        return [(call, True), (f"[{answer}]", False), (answer, True)], \
            rng.random() < DECIDE_SHARE
    return [(problem.partition("*")[0], True)], True


def warm(data: Path, out: Path, steps: int = 300, seed: int = 0) -> Path:
    """The task's tiny model under `out`, fitted `steps` AdamW steps (see module)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = load_config(overrides=[*task_overrides(data), f"run.seed={seed}"])
    source = make_source(cfg)
    path = model_dir(cfg, out.parent / f".{out.name}-build", source.alphabet)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    source.prepare(tokenizer)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(seed)
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    for _ in range(steps):
        rows = source.sample(32)
        completions, trained = [], []
        for row in rows:
            parts, decide = demonstration(row.prompt, row.columns["answer"], rng)
            tokens, keep = [], []
            for text, kept in parts:
                tokens += encode(text)
                keep += [int(kept)] * len(encode(text))
            keep[0] = int(decide)
            completions.append(tokens + [tokenizer.eos_token_id])
            trained.append(keep + [1])
        input_ids, targets, mask = pack_batch([r.tokens for r in rows], completions,
                                              tokenizer.pad_token_id)
        for row, (prompt, keep) in enumerate(zip(rows, trained, strict=True)):
            start = len(prompt.tokens) - 1
            mask[row, start:start + len(keep)] *= torch.tensor(keep, dtype=mask.dtype)
        supervised_step(model, optimizer, input_ids, targets, mask)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("data", type=Path, help="multiply.py's directory")
    parser.add_argument("out", type=Path, help="the starting model's directory")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"wrote {warm(args.data, args.out, args.steps, args.seed)}")


if __name__ == "__main__":
    main()
