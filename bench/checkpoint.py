"""What a trainer checkpoint costs a training step: a synchronous save against an
asynchronous one (`PolicyTrainer.save_checkpoint(wait=False)`: staged, written while the
next step runs), on one proc, for the RL loop's default tiny model and a larger one.

Per model, `--rounds` times (medians reported): a step alone; `save(wait=True)` then a
step; `save(wait=False)` then a step (the write in the background), then the wait. A save's
cost to the step is (save + step) - step alone; the async save's background write is
reported apart (what `wait_checkpoint` would block on if called at once).

    .venv/bin/python -m bench.checkpoint [--rounds 5] [--out runs/bench_checkpoint]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import announce
from colocate.engines.models import load_model
from colocate.engines.tiny import write_tiny_model
from colocate.engines.trainer import PolicyTrainer

# the RL loop's default policy (examples/rl_loop/config.yaml), and a larger one
MODELS = {
    "rl_loop default (llama 64x2)": dict(architecture="llama", hidden_size=64, layers=2,
                                         heads=2, kv_heads=1, intermediate_size=128,
                                         max_positions=16),
    "llama 256x4": dict(architecture="llama", hidden_size=256, layers=4, heads=4, kv_heads=2,
                        intermediate_size=1024, max_positions=16),
}
BATCH = (128, 16)  # the loop's default: 32 prompts x 4 samples, 16 positions


def ce_loss(module, batch):
    logits = module(input_ids=batch).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                             batch[:, 1:].flatten()), {}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(name: str, options: dict, rounds: int, root: Path) -> dict:
    path = write_tiny_model(root / name.replace(" ", "_"), alphabet="0123456789>",
                            init_std=0.1, **options)
    trainer = PolicyTrainer(load_model(path), prefix=f"bench{len(name)}{options['layers']}")
    batch = torch.randint(3, 14, BATCH, generator=torch.Generator().manual_seed(0))
    step = lambda: trainer.step(ce_loss, batch)  # noqa: E731
    for _ in range(2):  # warm-up (and AdamW state made)
        step()
    alone, sync, async_, staged, background = [], [], [], [], []
    for i in range(rounds):
        alone.append(timed(step))
        sync.append(timed(lambda i=i: (trainer.save_checkpoint(root / f"sync{i}"), step())))
        start = time.perf_counter()
        trainer.save_checkpoint(root / f"async{i}", wait=False)
        staged.append(time.perf_counter() - start)
        step()
        async_.append(time.perf_counter() - start)
        background.append(timed(trainer.wait_checkpoint) + async_[-1] - staged[-1])
    med = {k: statistics.median(v) for k, v in (("step", alone), ("sync", sync),
                                                 ("async", async_), ("staged", staged),
                                                 ("background", background))}
    params = sum(p.numel() for p in trainer.model.parameters())
    checkpoint_mib = sum(f.stat().st_size for f in (root / "sync0").rglob("*")
                         if f.is_file()) / 2**20
    return {"model": name, "params": params, "checkpoint_mib": round(checkpoint_mib, 2),
            "step_s": med["step"], "sync_cost_s": med["sync"] - med["step"],
            "async_cost_s": med["async"] - med["step"], "async_staging_s": med["staged"],
            "async_write_s": med["background"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="runs/bench_checkpoint")
    args = parser.parse_args()
    machine, command = announce()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, options in MODELS.items():
            rows.append(measure(name, options, args.rounds, Path(tmp)))
    print(f"{'model':30} {'params':>9} {'ckpt MiB':>8} {'step s':>7} {'sync +s':>8} "
          f"{'async +s':>8} {'sync/async':>10} {'staging s':>9} {'bg write s':>10}")
    for r in rows:
        ratio = r["sync_cost_s"] / max(r["async_cost_s"], 1e-6)
        print(f"{r['model']:30} {r['params']:>9} {r['checkpoint_mib']:>8} {r['step_s']:>7.3f} "
              f"{r['sync_cost_s']:>8.3f} {r['async_cost_s']:>8.3f} {ratio:>10.1f} "
              f"{r['async_staging_s']:>9.3f} {r['async_write_s']:>10.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"machine": machine, "command": command,
                                                  "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
