"""Two tenants take turns on one process's memory: the memory layer's demo.

A "trainer" (a model and its AdamW state, kept across sleeps) and a "generator" (its own
weights, kept, plus a KV-cache-like scratch buffer, discarded) alternate: each turn wakes
one, works, and puts it back to sleep. Prints the switch timeline and writes
`memory.png` and `timeline.json` under --out.

    python -m examples.two_tenants --rounds 6 --mib 256
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import torch
from tqdm import tqdm

from colocate import memory, telemetry

MiB = 1 << 20


def checksum(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:12]


def build(mib: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.nn.Module, torch.Tensor]:
    layer_mib = 4  # one 1024 x 1024 float32 Linear
    with memory.region("trainer", backup=True, device="cpu"):  # weights, grads, 2 moments
        trainer = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024)
                                        for _ in range(max(1, mib // (4 * layer_mib)))])
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-4)
    with memory.region("generator", backup=True, device="cpu"):  # half weights, half cache
        generator = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024)
                                          for _ in range(max(1, mib // (2 * layer_mib)))])
    with memory.region("generator-cache", device="cpu"):
        cache = torch.zeros(mib * MiB // 2 // 4)
    return trainer, optimizer, generator, cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--mib", type=int, default=256, help="memory per tenant")
    parser.add_argument("--out", type=Path, default=Path("runs/two_tenants"))
    args = parser.parse_args()

    trainer, optimizer, generator, cache = build(args.mib)
    x = torch.randn(16, 1024)
    trainer(x).pow(2).mean().backward()
    optimizer.step()  # optimizer state appears on the first step; put it under the tag
    memory.adopt([trainer, optimizer], "trainer", backup=True)
    for tag in memory.tags():
        print(f"{tag:>16}: {memory.tagged_bytes(tag) / MiB:7.1f} MiB")
    memory.pause("generator")
    memory.pause("generator-cache")

    for _ in tqdm(range(args.rounds), desc="rounds"):
        before = checksum(trainer)
        memory.pause("trainer")                 # generation phase
        memory.resume("generator")
        memory.resume("generator-cache")
        cache[: x.numel()] = generator(x).flatten()
        memory.pause("generator-cache")
        memory.pause("generator")
        memory.resume("trainer")                # training phase
        assert checksum(trainer) == before, "trainer weights changed while asleep"
        optimizer.zero_grad(set_to_none=False)  # keep grads in the tagged memory
        trainer(x).pow(2).mean().backward()
        optimizer.step()

    timeline = telemetry.timeline()
    print(f"\n{'op':>7} {'tag':>16} {'MiB':>7} {'ms':>7} {'GB/s':>6} {'RSS before':>11} "
          f"{'RSS after':>10}")
    for e in timeline.events:
        print(f"{e.op:>7} {e.tag:>16} {e.nbytes / MiB:7.1f} {e.seconds * 1e3:7.1f} "
              f"{e.gbps:6.2f} {e.before_bytes / MiB:9.0f}Mi {e.after_bytes / MiB:8.0f}Mi")
    args.out.mkdir(parents=True, exist_ok=True)
    timeline.to_json(args.out / "timeline.json")
    timeline.plot(args.out / "memory.png")
    print(f"\nwrote {args.out / 'memory.png'} and {args.out / 'timeline.json'}")


if __name__ == "__main__":
    main()
