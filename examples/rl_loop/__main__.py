"""`python -m examples.rl_loop [--config FILE] [--engine vllm] [section.field=value ...]`:
GRPO on the toy task with the trainer and the generator time-sharing the same slots.
Writes reward.png, memory.png and metrics.json under run.out (default runs/rl_loop).
`--plan` prints what each switch of a step will move and cost, and whether the run fits,
without running it (exit status 3 when it does not fit); `--calibrate` measures the
switches' fixed costs on this machine (examples/rl_loop/plan.py, colocate/planning).

A setting or input the run cannot use (a field, a value, a data file, a reward function, a
model directory, a checkpoint to resume) is refused before anything starts, as one line
`error: ...` on stderr and exit status 2; a failure during the run keeps its traceback.
`--help` lists every field with its type, default and meaning (from the comments beside
the fields in their dataclasses)."""

from __future__ import annotations

import argparse
import ast
import asyncio
import inspect
import io
import json
import shutil
import sys
import textwrap
import tokenize
from dataclasses import fields
from typing import Any, NoReturn

from examples.rl_loop.config import RLConfig, as_dict, as_overridden, load_config, sections
from examples.rl_loop.rewards import RewardError
from examples.rl_loop.state import ResumeError

# refused before the runtime starts: the config, the data files, the reward functions, the
# model directory (`colocate.engines.models.ModelDirError` is a ValueError), run.out
REFUSED = (ValueError, OSError, RewardError, ResumeError)


def main(argv: list[str] | None = None) -> None:
    parser = FieldsHelp(prog="python -m examples.rl_loop",
                        description="\n".join(__doc__.split("\n")[1:3]),
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML file (default: examples/rl_loop/config.yaml)")
    parser.add_argument("--engine", choices=["torch", "vllm"], help="the generator engine")
    parser.add_argument("--plan", action="store_true",
                        help="print the run's plan for one step and write it as JSON "
                             "(--plan-out, default run.out/plan.json); nothing runs")
    parser.add_argument("--plan-out", help="where --plan writes its JSON")
    parser.add_argument("--rates", help="the rates file a plan is priced with (default: "
                                        "run.rates, else this machine's, calibrated once)")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure this machine's switch costs with two short runs and "
                             "keep them in the rates file (--rates, or this machine's)")
    parser.add_argument("overrides", nargs="*", help="section.field=value, e.g. run.steps=20")
    args = parser.parse_args(argv)
    overrides = list(args.overrides) + ([f"run.engine={args.engine}"] if args.engine else [])
    overrides += [f"run.rates={args.rates}"] if args.rates else []
    try:
        cfg = load_config(args.config, overrides)
    except ValueError as err:
        refuse(err)
    if args.calibrate:
        from examples.rl_loop.calibrate import calibrate_switches

        print(json.dumps(calibrate_switches(args.rates), indent=2))
        return
    if args.plan:
        from examples.rl_loop.plan import print_plan

        try:
            fits = print_plan(cfg, args.plan_out)
        except REFUSED as err:
            refuse(err)
        sys.exit(0 if fits else 3)
    from examples.rl_loop.loop import Loop  # torch and the runtime: after the config

    try:
        loop = Loop(cfg)  # checks the data, the reward functions and the model first
    except REFUSED as err:
        refuse(err)
    try:
        summary = asyncio.run(loop.run())
    except ResumeError as err:  # run.resume or run.out, checked before the runtime starts
        refuse(err)
    except ValueError as err:
        if getattr(loop, "rm", None) is not None:  # the runtime started: a failure of the run
            raise
        refuse(err)  # e.g. run.steps below the checkpoint's step
    print(json.dumps(summary, indent=2))
    print(f"wrote {cfg.run.out}/reward.png, memory.png, metrics.json")


class FieldsHelp(argparse.ArgumentParser):
    """The parser, whose help ends with every config field (built only when shown)."""

    def format_help(self) -> str:
        self.epilog = fields_help()
        return super().format_help()


def refuse(err: BaseException) -> NoReturn:
    """`error: <message>` on one line on stderr, and exit status 2 (no traceback)."""
    message = " ".join(as_overridden(str(err) or type(err).__name__).split())
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def meanings(cls: type) -> dict[str, str]:
    """Each field's meaning, from the comments beside it in `cls`'s source: the comment on
    its line, with the comment lines right below it (when the next field has a comment of
    its own); or, without one, the comment lines right above it."""
    try:
        source = inspect.getsource(inspect.getmodule(cls))
    except (OSError, TypeError):  # no source (a frozen install): no meanings
        return {}
    comments: dict[int, tuple[str, bool]] = {}  # line: (text, the line holds only it)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            alone = not token.line[:token.start[1]].strip()
            comments[token.start[0]] = (token.string.lstrip("#").strip(), alone)
    body = next(node for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.ClassDef) and node.name == cls.__name__).body
    names = [(n.target.id, n.lineno, n.end_lineno) for n in body
             if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]

    def block(lines: range) -> list[int]:  # the comment-only lines in a row from the first
        found = []
        for line in lines:
            if not comments.get(line, ("", False))[1]:
                break
            found.append(line)
        return found

    out: dict[str, list[str]] = {}
    for index, (name, first, last) in enumerate(names):
        own = [comments[line][0] for line in range(first, last + 1)
               if line in comments and not comments[line][1]]
        above = sorted(block(range(first - 1, 0, -1)))
        if not own:
            out[name] = [comments[line][0] for line in above]
            continue
        out[name] = own
        after = block(range(last + 1, last + 1000))
        following = names[index + 1] if index + 1 < len(names) else None
        if following is None or any(line in comments and not comments[line][1]
                                    for line in range(following[1], following[2] + 1)):
            out[name] += [comments[line][0] for line in after]
    return {name: " ".join(text) for name, text in out.items()}


# the meaning of the fields whose module has no comment beside them (the test checks that
# every field has one, from its comments or from here, and that none is in both)
UNCOMMENTED = {
    "task.min_digits": "the shortest digit string to copy",
    "task.max_digits": "the longest digit string to copy",
    "task.eval_size": "held-out prompts, never trained on, that eval_reward is measured on",
    "task.eval_seed": "the seed that draws the held-out prompts",
    "grpo.prompts_per_step": "prompts a step; each is sampled group_size times",
    "grpo.lr": "AdamW's learning rate",
    "grpo.max_grad_norm": "gradients are clipped to this norm",
}


def field_rows() -> list[tuple[str, str, str, str]]:
    """(section.field, type, default, meaning) of every field; the defaults are a run's
    without --config: config.yaml's values over the dataclasses'."""
    try:
        defaults = as_dict(load_config())
    except ValueError:  # a broken config.yaml: the dataclasses' own
        defaults = as_dict(RLConfig())
    rows = []
    for section, cls in sections().items():
        meaning = meanings(cls)
        for f in fields(cls):
            key = f"{section}.{f.name}"
            kind = f.type if isinstance(f.type, str) else f.type.__name__
            rows.append((key, kind, _shown(defaults[section][f.name]),
                         meaning.get(f.name) or UNCOMMENTED.get(key, "")))
    return rows


def fields_help(width: int | None = None) -> str:
    """The fields as `--help` lists them: one row each, `section.field  type  default
    meaning`, the meaning wrapped below its column (to the terminal's width)."""
    width = width or max(100, shutil.get_terminal_size((120, 24)).columns - 2)
    rows = field_rows()
    key_w, kind_w, default_w = (max(len(row[i]) for row in rows) for i in range(3))
    default_w = min(default_w, 14)
    lines = ["fields (section.field=value; defaults: config.yaml's):"]
    indent = 2 + key_w + 2 + kind_w + 2 + default_w + 2
    for section in sections():
        lines.append("")
        for key, kind, default, meaning in rows:
            if not key.startswith(f"{section}."):
                continue
            head = f"  {key:<{key_w}}  {kind:<{kind_w}}  {default:<{default_w}}  "
            if len(head) > indent:  # a long default: the meaning on the next line
                lines.append(head.rstrip())
                head = " " * indent
            wrapped = textwrap.wrap(meaning, max(width - indent, 30)) or [""]
            lines.append(head + wrapped[0])
            lines += [" " * indent + more for more in wrapped[1:]]
    return "\n".join(line.rstrip() for line in lines)


def _shown(value: Any) -> str:
    """A default as it is written on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(_shown(v) for v in value) + "]"
    return str(value)


if __name__ == "__main__":
    main()
