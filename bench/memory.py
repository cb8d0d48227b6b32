"""Pause/resume cost of tagged memory, against the raw operations it is built from.

For each size (MiB), in a fresh spawned process so that RSS readings start clean, and taking
the median of `--repeats` pause/resume cycles:

CPU (the mmap arena, `colocate.memory.arena`):
  - backup=True: a tensor of random bytes is adopted under a tag, then paused to disk
    (`place="disk"`: written to an unlinked file in `$COLOCATE_BACKUP_DIR` or the temp dir,
    each piece `MADV_DONTNEED`ed once written) and
    resumed (read back into the same pages). Released fraction = RSS drop over the pause /
    bytes. After every resume the contents are compared with a copy taken before adoption;
    any difference raises. The copy is resident through both RSS readings, so it cancels.
  - raw baselines for the same bytes in the same run: `dst.copy_(src)` between two resident
    tensors (memcpy); `os.pwrite` of the bytes to a new file in the same directory, no fsync
    (raw write); `os.preadv` of that file into a tensor allocated just before, so its page
    faults are counted as in our resume (raw read).
  - backup=False on another tag: pause (`MADV_DONTNEED`) and resume (fault in zero pages).
CUDA (torch_memory_saver, when torch sees a GPU): the same with a CUDA tensor; backup=True
  copies the tag's storages to a pinned host buffer (`colocate.memory.pinned`) before
  torch_memory_saver unmaps them, and back after the resume. Released fraction uses
  NVML's used bytes on the device. Raw write = device->host `copy_` into a pinned tensor,
  raw read = host->device, memcpy = device->device; every timing is bracketed by
  `torch.cuda.synchronize()`.

With `--tensor-kib 0,64` each size is measured twice: as one tensor (0), and as the same
bytes in tensors of 64 KiB each (a tag of many small tensors: 4096 of them in 256 MiB),
against the same raw copies of the bytes in one piece.

Targets (PASS/FAIL per row): released fraction >= 0.99; backup pause and resume bandwidth
>= 0.8x the raw write and raw read bandwidth; discard pause <= 50 ms per GiB (CPU only).
GB/s are 1e9 bytes per second. Python's GC is off during each timed call, as in timeit.
Each row is printed as soon as its size is measured (a run stopped early keeps its rows).

    python -m bench.memory [--sizes 64,256,1024,2048] [--device cpu|cuda] [--repeats 3]
                           [--tensor-kib 0] [--out runs/bench_memory]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import multiprocessing as mp
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import torch
from tqdm import tqdm

from colocate import memory, telemetry

MIB, GIB, GB = 1 << 20, 1 << 30, 1e9
MIN_RELEASED = 0.99
MIN_VS_RAW = 0.8
MAX_DISCARD_MS_PER_GIB = 50.0
Samples = dict[str, list[float]]


# -- timing and raw I/O --------------------------------------------------------------------

def _timed(fn: Callable[[], object], cuda: bool = False) -> float:
    """Seconds that `fn` takes, with Python's GC held off as timeit does (a gen-2 pass in a
    torch process takes ~100 ms) and, on CUDA, the device drained before and after."""
    if cuda:
        torch.cuda.synchronize()
    gc.disable()
    try:
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start
    finally:
        gc.enable()


def _view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy, no page touched)."""
    buffer = (ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())
    return memoryview(buffer).cast("B")


def _write_all(fd: int, view: memoryview) -> None:
    offset = 0
    while offset < len(view):
        offset += os.pwrite(fd, view[offset:], offset)


def _read_all(fd: int, view: memoryview) -> None:
    offset = 0
    while offset < len(view):
        got = os.preadv(fd, [view[offset:]], offset)
        if got == 0:
            raise OSError(f"file ended early at offset {offset}")
        offset += got


def _random_bytes(nbytes: int, device: str) -> torch.Tensor:
    return torch.empty(nbytes // 8, dtype=torch.int64, device=device).random_().view(torch.uint8)


def _check(tensor: torch.Tensor, reference: torch.Tensor, what: str) -> None:
    if not torch.equal(tensor, reference):
        raise RuntimeError(f"{what}: contents differ from the copy taken before pausing")


# -- one size, in its own process ----------------------------------------------------------

def _cycle(tag: str, nbytes: int, read: Callable[[], int], cuda: bool, samples: Samples,
           prefix: str = "") -> None:
    """One timed pause/resume of `tag`, with the memory `read()` says the pause released."""
    if cuda:  # the pause empties the allocator's cache too (`release_cached`): only the
        torch.cuda.empty_cache()  # tag's bytes count (the H200 run read 2.0 without this)
    before = read()
    # on CPU to disk, as its raw baselines write (the budget's fallback; host memory, the
    # default place, is the same pwrite into a memfd)
    place = memory.HOST if cuda else memory.DISK
    samples[f"{prefix}pause_s"].append(_timed(lambda: memory.pause(tag, place), cuda))
    samples[f"{prefix}released"].append((before - read()) / nbytes)
    samples[f"{prefix}resume_s"].append(_timed(lambda: memory.resume(tag), cuda))


def _empty_samples() -> Samples:
    return {key: [] for key in (
        "pause_s", "resume_s", "released", "raw_write_s", "raw_read_s", "memcpy_s",
        "discard_pause_s", "discard_resume_s", "discard_released")}


def _raw_cpu(reference: torch.Tensor, backup_dir: str, samples: Samples) -> None:
    """The raw operations on the same bytes: file write, file read into fresh memory, memcpy."""
    with tempfile.TemporaryFile(dir=backup_dir) as file:  # a new file, as each pause makes
        source = _view(reference)
        samples["raw_write_s"].append(_timed(lambda: _write_all(file.fileno(), source)))
        fresh = torch.empty_like(reference)  # untouched: its page faults are timed, as in resume
        samples["raw_read_s"].append(_timed(lambda: _read_all(file.fileno(), _view(fresh))))
    _check(fresh, reference, "raw read baseline")
    target = torch.zeros_like(reference)  # resident before the copy
    samples["memcpy_s"].append(_timed(lambda: target.copy_(reference)))


def _raw_cuda(reference: torch.Tensor, host: torch.Tensor, target: torch.Tensor,
              samples: Samples) -> None:
    """Device->pinned host, pinned host->device and device->device copies of the bytes."""
    samples["raw_write_s"].append(_timed(lambda: host.copy_(reference), cuda=True))
    samples["raw_read_s"].append(_timed(lambda: target.copy_(host), cuda=True))
    _check(target, reference, "raw host->device baseline")
    samples["memcpy_s"].append(_timed(lambda: target.copy_(reference), cuda=True))


def _backup(nbytes: int, repeats: int, device: str, read: Callable[[], int],
            samples: Samples, piece: int = 0) -> None:
    """backup=True cycles of random bytes (one tensor, or tensors of `piece` bytes), each
    checked and followed by the raw baselines on the bytes in one piece."""
    reference = _random_bytes(nbytes, device)  # resident in both readings: it cancels out
    pieces = list(reference.split(piece)) if piece else [reference]
    tensors = [p.clone() for p in pieces]  # a storage each
    baseline: Callable[[], None]
    if device == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        target = torch.empty(nbytes, dtype=torch.uint8, device=device)
        baseline = partial(_raw_cuda, reference, host, target, samples)
    else:
        backup_dir = os.environ.get("COLOCATE_BACKUP_DIR") or tempfile.gettempdir()
        baseline = partial(_raw_cpu, reference, backup_dir, samples)
    memory.adopt(tensors, "bench", backup=True)
    for i in range(repeats):
        _cycle("bench", nbytes, read, device == "cuda", samples)
        _check(torch.cat(tensors) if piece else tensors[0], reference,
               f"{nbytes // MIB} MiB on {device}, cycle {i + 1}")
        baseline()


def _discard(nbytes: int, repeats: int, device: str, read: Callable[[], int],
             samples: Samples) -> None:
    """backup=False cycles on another tag."""
    tensor = torch.ones(nbytes, dtype=torch.uint8, device=device)
    memory.adopt(tensor, "bench-discard", backup=False)
    for _ in range(repeats):
        _cycle("bench-discard", nbytes, read, device == "cuda", samples, "discard_")


def _gpu_used() -> int:
    torch.cuda.synchronize()
    return telemetry.read_gpu(torch.cuda.current_device()).used_bytes


def measure(size_mib: int, device: str, repeats: int, tensor_kib: int = 0) -> Samples:
    """Every sample for one size on `device` (the backed-up bytes in tensors of
    `tensor_kib` KiB, or one tensor for 0); runs in a child process."""
    nbytes = size_mib * MIB
    read = _gpu_used if device == "cuda" else telemetry.process_rss
    samples = _empty_samples()
    _backup(nbytes, repeats, device, read, samples, tensor_kib << 10)  # freed on return
    if device == "cuda":
        torch.cuda.empty_cache()
    _discard(nbytes, repeats, device, read, samples)
    return samples


# -- results ---------------------------------------------------------------------------------

def summarise(size_mib: int, device: str, samples: Samples,
              tensor_kib: int = 0) -> dict[str, Any]:
    """One row: medians, bandwidths, ratios and verdicts."""
    nbytes = size_mib * MIB
    med = {key: statistics.median(values) for key, values in samples.items()}
    gbps = {key: nbytes / med[f"{key}_s"] / GB
            for key in ("pause", "resume", "raw_write", "raw_read", "memcpy")}
    row: dict[str, Any] = {
        "size_mib": size_mib,
        "tensors": -(-nbytes // (tensor_kib << 10)) if tensor_kib else 1,
        "device": device,
        "pause_ms": med["pause_s"] * 1e3,
        "resume_ms": med["resume_s"] * 1e3,
        **{f"{key}_gbps": value for key, value in gbps.items()},
        "pause_vs_raw": gbps["pause"] / gbps["raw_write"],
        "resume_vs_raw": gbps["resume"] / gbps["raw_read"],
        "pause_vs_memcpy": gbps["pause"] / gbps["memcpy"],
        "resume_vs_memcpy": gbps["resume"] / gbps["memcpy"],
        "released": med["released"],
        "discard_pause_ms": med["discard_pause_s"] * 1e3,
        "discard_resume_ms": med["discard_resume_s"] * 1e3,
        "discard_pause_ms_per_gib": med["discard_pause_s"] * 1e3 / (nbytes / GIB),
        "discard_released": med["discard_released"],
        "samples": samples,
    }
    verdicts = {
        "release": row["released"] >= MIN_RELEASED,
        "pause": row["pause_vs_raw"] >= MIN_VS_RAW,
        "resume": row["resume_vs_raw"] >= MIN_VS_RAW,
    }
    if device == "cpu":
        verdicts["discard"] = row["discard_pause_ms_per_gib"] <= MAX_DISCARD_MS_PER_GIB
    row["verdicts"] = verdicts
    return row


COLUMNS = [  # header, row key, format
    ("size MiB", "size_mib", "{}"),
    ("tensors", "tensors", "{}"),
    ("pause ms", "pause_ms", "{:.1f}"),
    ("resume ms", "resume_ms", "{:.1f}"),
    ("pause GB/s", "pause_gbps", "{:.2f}"),
    ("resume GB/s", "resume_gbps", "{:.2f}"),
    ("raw write GB/s", "raw_write_gbps", "{:.2f}"),
    ("raw read GB/s", "raw_read_gbps", "{:.2f}"),
    ("memcpy GB/s", "memcpy_gbps", "{:.2f}"),
    ("pause/raw", "pause_vs_raw", "{:.2f}"),
    ("resume/raw", "resume_vs_raw", "{:.2f}"),
    ("pause/memcpy", "pause_vs_memcpy", "{:.2f}"),
    ("resume/memcpy", "resume_vs_memcpy", "{:.2f}"),
    ("released fraction", "released", "{:.4f}"),
    ("discard pause ms/GiB", "discard_pause_ms_per_gib", "{:.1f}"),
]


HEADER = [name for name, _, _ in COLUMNS] + ["verdicts"]


def _cells(row: dict[str, Any]) -> list[str]:
    return ([fmt.format(row[key]) for _, key, fmt in COLUMNS]
            + [" ".join(f"{k}:{'PASS' if ok else 'FAIL'}" for k, ok in row["verdicts"].items())])


def _render(cells: list[str], widths: list[int]) -> str:
    return "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)) + " |"


def _rule(widths: list[int]) -> str:
    return "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"


def table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of the rows, one line each, with the verdicts last."""
    lines = [_cells(row) for row in rows]
    widths = [max(len(cell) for cell in column) for column in zip(HEADER, *lines, strict=True)]
    return "\n".join([_render(HEADER, widths), _rule(widths),
                      *(_render(line, widths) for line in lines)])


def table_head() -> str:
    """The table's header and rule, printed before any row is measured (`table_row`)."""
    widths = [len(name) for name in HEADER]
    return "\n".join([_render(HEADER, widths), _rule(widths)])


def table_row(row: dict[str, Any]) -> str:
    """One row of the table under `table_head`, printed as soon as it is measured."""
    return _render(_cells(row), [len(name) for name in HEADER])


def machine(device: str) -> dict[str, Any]:
    if device == "cuda":
        name = torch.cuda.get_device_name(0)
    else:
        cpuinfo = Path("/proc/cpuinfo")
        lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
        models = [line.split(":", 1)[1].strip() for line in lines
                  if line.startswith("model name")]
        name = models[0] if models else platform.processor() or "unknown CPU"
    return {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / GIB, 1),
        "torch": torch.__version__,
        "device": device,
        "device_name": name,
        "backup_dir": os.environ.get("COLOCATE_BACKUP_DIR") or tempfile.gettempdir(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256,1024,2048", help="MiB, comma-separated")
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tensor-kib", default="0",
                        help="KiB per tensor of the backed-up bytes, comma-separated; "
                             "0: one tensor")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_memory"))
    args = parser.parse_args(argv)
    sizes = [int(size) for size in args.sizes.split(",") if size.strip()]
    pieces = [int(kib) for kib in args.tensor_kib.split(",") if kib.strip()]
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device")
    if args.repeats < 1 or not sizes or min(sizes) < 1:
        parser.error("--repeats and every size must be >= 1")
    if not pieces or min(pieces) < 0:
        parser.error("--tensor-kib: sizes >= 0 (0: one tensor)")

    info = machine(args.device)
    command = shlex.join(sys.orig_argv)
    header = (f"machine: {info['platform']}, {info['cpus']} CPUs, {info['memory_gib']} GiB, "
              f"torch {info['torch']}, {info['device']}: {info['device_name']}, backup dir "
              f"{info['backup_dir']} | command: {command}")
    print(header, flush=True)

    rows: list[dict[str, Any]] = []
    context = mp.get_context("spawn")
    args.out.mkdir(parents=True, exist_ok=True)
    print(table_head(), flush=True)
    for size, kib in tqdm([(size, kib) for size in sizes for kib in pieces], desc="sizes",
                          unit="size"):
        with context.Pool(1) as pool:  # a fresh process per size: clean RSS readings
            samples = pool.apply(measure, (size, args.device, args.repeats, kib))
        rows.append(summarise(size, args.device, samples, kib))
        tqdm.write(table_row(rows[-1]))  # now: a run stopped later keeps it
        sys.stdout.flush()
        results = {"header": header, "machine": info, "command": command,
                   "repeats": args.repeats, "rows": rows,
                   "targets": {"released_min": MIN_RELEASED, "vs_raw_min": MIN_VS_RAW,
                               "discard_pause_ms_per_gib_max": MAX_DISCARD_MS_PER_GIB}}
        (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"\n{table(rows)}")
    print(f"results: {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
