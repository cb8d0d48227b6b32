"""A starting model for `multiply.py`'s task that knows the calculator's call format, as an
instruction-tuned model knows its tools' format before RL: the tiny model the loop would
build for the task, fitted by teacher forcing to demonstrations of the format only.

    python examples/rl_loop/tasks/multiply_warm.py runs/multiply/data runs/multiply/start

Each demonstration is a training prompt, a call of the calculator with *another* problem's
expression, the observation, and that observation copied as the answer:
`123*456=` -> `c(802*311)[249422]249422` and the stop token (the observation's tokens are
not trained on, as in a rollout). The model learns to call and to answer with what the tool
said, not which expression to call with: its held-out answers start wrong, and RL teaches
it to put the problem's own numbers in the call (`multiply_reward.py:called` rewards that).
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


def demonstration(rng: random.Random) -> tuple[str, str]:
    """A call of another problem and its answer: the written part and the observation."""
    a, b = rng.randint(100, 999), rng.randint(100, 999)
    return f"c({a}*{b})", f"[{a * b}]"


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
        for _ in rows:
            call, shown = demonstration(rng)
            answer = encode(shown[1:-1]) + [tokenizer.eos_token_id]
            completions.append(encode(call) + encode(shown) + answer)
            trained.append([1] * len(encode(call)) + [0] * len(encode(shown))
                           + [1] * len(answer))
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
