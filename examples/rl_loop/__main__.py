"""`python -m examples.rl_loop [--config FILE] [--engine vllm] [section.field=value ...]`:
GRPO on the toy task with the trainer and the generator time-sharing the same slots.
Writes reward.png, memory.png and metrics.json under run.out (default runs/rl_loop)."""

from __future__ import annotations

import argparse
import asyncio
import json

from examples.rl_loop.config import load_config
from examples.rl_loop.loop import Loop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="YAML file (default: examples/rl_loop/config.yaml)")
    parser.add_argument("--engine", choices=["torch", "vllm"], help="the generator engine")
    parser.add_argument("overrides", nargs="*", help="section.field=value, e.g. run.steps=20")
    args = parser.parse_args()
    overrides = list(args.overrides) + ([f"run.engine={args.engine}"] if args.engine else [])
    cfg = load_config(args.config, overrides)
    summary = asyncio.run(Loop(cfg).run())
    print(json.dumps(summary, indent=2))
    print(f"wrote {cfg.run.out}/reward.png, memory.png, metrics.json")


if __name__ == "__main__":
    main()
