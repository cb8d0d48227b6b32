"""What the Monarch benchmarks share: the machine they ran on, the command, a path the
procs can import the benchmark's own actors from, and timing a call."""

from __future__ import annotations

import asyncio
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def announce() -> tuple[dict[str, Any], str]:
    """Print and return the machine and the command; give the procs started after this the
    repo root on PYTHONPATH, so they can unpickle actors defined under bench/."""
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    info = {"platform": platform.platform(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "cuda": torch.cuda.is_available()}
    command = shlex.join(sys.orig_argv)
    print(f"machine: {info['platform']}, {info['cpus']} CPUs, torch {info['torch']}, "
          f"cuda {info['cuda']} | command: {command}")
    return info, command


async def timed(fn: Callable[[], Awaitable[object]]) -> float:
    start = time.perf_counter()
    await fn()
    return time.perf_counter() - start


async def median_s(fn: Callable[[], Awaitable[object]], repeats: int = 20,
                   gap_s: float = 0.0) -> float:
    """The median seconds of `repeats` calls, each after `gap_s` of quiet (a Monarch round
    trip after 10 ms or more of quiet takes ~3x one made back to back: bench/RESULTS.md)."""
    times = []
    for _ in range(repeats):
        if gap_s:
            await asyncio.sleep(gap_s)
        times.append(await timed(fn))
    return statistics.median(times)
