"""GRPO on a toy task with the trainer and the generator colocated: `python -m examples.rl_loop`."""
