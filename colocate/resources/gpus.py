"""GPU discovery: this host's GPUs as NVML lists them, and which one a GPU slot's proc gets.

GPU slots: slot i of a host is the i-th GPU that the host's procs may use (`visible_gpus`:
the host's inherited CUDA_VISIBLE_DEVICES, indices read in its CUDA_DEVICE_ORDER, or every
GPU in PCI bus order). A slot's proc gets CUDA_VISIBLE_DEVICES=<that GPU's UUID>, resolved
on its own host when it starts (`run_on_slot_gpu`), so neither NVML's nor CUDA's numbering,
nor another host's GPUs, can put it on the wrong GPU.

NVML is probed once per process (`colocate.telemetry.nvml`): absent means no GPUs; any other
NVML error is raised as `NvmlError` naming the call, not taken for "no GPUs".
"""

from __future__ import annotations

import os
import runpy
from collections.abc import Mapping
from dataclasses import dataclass

from colocate.telemetry.nvml import NvmlError, nvml

GPU_SLOT_ENV = "COLOCATE_GPU_SLOT"  # set at bootstrap: resolve this slot's GPU, then start


@dataclass(frozen=True)
class Gpu:
    """One GPU as NVML lists it (NVML's order is the PCI bus order)."""

    uuid: str  # "GPU-..."
    name: str  # the model, e.g. "NVIDIA H100 80GB HBM3"


def nvml_available() -> bool:
    """Whether this process can ask NVML about GPUs (probed on the first call only)."""
    return nvml() is not None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def nvml_gpus() -> list[Gpu]:
    """This host's GPUs in NVML (PCI bus) order, whatever CUDA_VISIBLE_DEVICES says; empty
    where NVML is absent (no driver, no GPU, no pynvml). Raises `NvmlError` when NVML is
    there but fails."""
    lib = nvml()
    if lib is None:
        return []
    call = "nvmlDeviceGetCount"
    try:
        found = []
        for i in range(int(lib.nvmlDeviceGetCount())):
            call = f"nvmlDeviceGetHandleByIndex({i})"
            handle = lib.nvmlDeviceGetHandleByIndex(i)
            call = f"nvmlDeviceGetUUID/Name of GPU {i}"
            found.append(Gpu(_text(lib.nvmlDeviceGetUUID(handle)),
                             _text(lib.nvmlDeviceGetName(handle))))
        return found
    except lib.NVMLError as err:
        raise NvmlError(f"{call} failed: {err}") from err


def visible_gpus(env: Mapping[str, str], gpus: list[Gpu]) -> list[str]:
    """The UUIDs of the GPUs that a process started with `env` may use, in its CUDA order;
    `gpus` is the host's GPUs in NVML (PCI bus) order.

    Without CUDA_VISIBLE_DEVICES: every GPU, in PCI bus order. With it: its entries, UUIDs
    (or unique UUID prefixes) or indices, read as CUDA reads them (up to the first invalid
    one). Indices count in CUDA_DEVICE_ORDER: PCI_BUS_ID is NVML's order; the default,
    FASTEST_FIRST, puts the fastest GPU first and leaves the rest unspecified, taken here as
    PCI bus order only when every GPU is the same model (else refused: the index could name
    another GPU)."""
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [g.uuid for g in gpus]
    order = env.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    found: list[str] = []
    for entry in (e.strip() for e in listed.split(",")):
        if entry.startswith(("GPU-", "MIG-")):
            matches = [g.uuid for g in gpus if g.uuid.startswith(entry)]
            if len(matches) != 1:
                break
            found.append(matches[0])
            continue
        if not entry.isdigit() or int(entry) >= len(gpus):
            break
        if order != "PCI_BUS_ID" and len({g.name for g in gpus}) > 1:
            raise ValueError(
                f"CUDA_VISIBLE_DEVICES={listed!r} lists indices, which in CUDA_DEVICE_ORDER="
                f"{order} order this host's different GPU models "
                f"({sorted({g.name for g in gpus})}) in an order NVML cannot tell. Set "
                "CUDA_DEVICE_ORDER=PCI_BUS_ID, or list GPU UUIDs (`nvidia-smi -L`)."
            )
        found.append(gpus[int(entry)].uuid)
    return list(dict.fromkeys(found))


def slot_gpu(slot: int, env: Mapping[str, str], gpus: list[Gpu]) -> str:
    """The UUID of GPU slot `slot` of a host whose procs start with `env`: the slot-th of
    `visible_gpus(env, gpus)`."""
    visible = visible_gpus(env, gpus)
    if not 0 <= slot < len(visible):
        inherited = env.get("CUDA_VISIBLE_DEVICES")
        raise ValueError(
            f"GPU slot {slot} does not exist on this host: its procs may use {len(visible)} "
            f"GPU(s) ({len(gpus)} found by NVML"
            + (f", CUDA_VISIBLE_DEVICES={inherited!r}" if inherited is not None else "")
            + "). Give init() a gpus_per_host that every host has."
        )
    return visible[slot]


def run_on_slot_gpu(module: str) -> None:
    """A GPU slot's proc bootstrap (see `colocate.resources.procs.bootstrap_command`): set
    CUDA_VISIBLE_DEVICES to the UUID of slot $COLOCATE_GPU_SLOT's GPU, resolved here on the
    proc's own host (its GPUs, its inherited CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER)
    before anything starts CUDA, then run `module` as `python -m` would."""
    slot = int(os.environ.pop(GPU_SLOT_ENV))
    os.environ["CUDA_VISIBLE_DEVICES"] = slot_gpu(slot, os.environ, nvml_gpus())
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def gpus_per_host() -> int:
    """GPUs on this host that its processes may use: NVML's count, narrowed by an inherited
    CUDA_VISIBLE_DEVICES (`visible_gpus`); 0 where NVML is absent (no driver, no GPU, no
    pynvml)."""
    return len(visible_gpus(os.environ, nvml_gpus()))
