"""What the Monarch benchmarks share: the machine they ran on, the command, and a path the
procs can import the benchmark's own actors from."""

from __future__ import annotations

import os
import platform
import shlex
import sys
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
