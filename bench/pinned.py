"""What pinned host memory costs: torch's `pin_memory()` (its caching host allocator rounds
each block up to a power of two, so 2.25 GiB pinned takes 4 GiB) against the memory
layer's own pinned buffers (`colocate.memory.pinned.pinned_host`: exactly the bytes asked,
registered with `cudaHostRegister`), per size: the seconds to pin, and the host memory each
takes (the process's RSS growth, pinned pages being resident). Needs CUDA: without it the
row says so and nothing is measured (the CPU backend's host backups are plain `memfd`
pages of the tag's bytes, checked in tests/test_host_budget.py).

    python -m bench.pinned [--sizes-mib 256,1024,2304] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import announce
from colocate import telemetry
from colocate.memory.pinned import pinned_host

MiB = 1 << 20


def measure(pin: Callable[[int], torch.Tensor], nbytes: int) -> dict[str, float]:
    """Seconds to pin `nbytes`, and the host bytes that took (RSS growth)."""
    gc.collect()
    before = telemetry.process_rss()
    began = time.perf_counter()
    held = pin(nbytes)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    grown = telemetry.process_rss() - before
    del held
    gc.collect()
    torch.cuda.synchronize()
    if hasattr(torch._C, "_host_emptyCache"):  # torch's cached pinned blocks go back too
        torch._C._host_emptyCache()
    return {"seconds": seconds, "host_bytes": grown, "host_over_asked": grown / nbytes}


def pin_memory(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8).pin_memory()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", default="256,1024,2304")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    info, command = announce()
    rows: list[dict] = []
    if not torch.cuda.is_available():
        print("bench/pinned.py: skipped, no CUDA here (pinned memory needs a GPU)")
    for size in ([] if not info["cuda"] else [int(s) for s in args.sizes_mib.split(",")]):
        nbytes = size * MiB
        row = {"size_mib": size, "pin_memory": measure(pin_memory, nbytes),
               "pinned_host": measure(pinned_host, nbytes)}
        rows.append(row)
        torch_row, ours = row["pin_memory"], row["pinned_host"]
        print(f"{size:6} MiB: pin_memory() {torch_row['seconds']:.3f} s, "
              f"{torch_row['host_bytes'] / MiB:.0f} MiB of host memory "
              f"({torch_row['host_over_asked']:.2f}x); pinned_host "
              f"{ours['seconds']:.3f} s, {ours['host_bytes'] / MiB:.0f} MiB "
              f"({ours['host_over_asked']:.2f}x)", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps({"machine": info, "command": command, "rows": rows},
                                       indent=2))


if __name__ == "__main__":
    main()
