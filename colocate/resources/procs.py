"""Slot procs: start Monarch procs that each know their slot (and GPU) before they start,
and stop them.

One function starts procs for a resource group and for the replacement of dead ones
(`spawn_slot_procs`): each proc gets `COLOCATE_SLOT` and, on a real GPU, the slot to
resolve to a GPU UUID at bootstrap (`gpus.run_on_slot_gpu` sets CUDA_VISIBLE_DEVICES),
plus torch_memory_saver's preload environment in preload mode. `stop_procs` stops a proc
mesh within a grace period, kills what is left by pid, and removes the shared-memory files
its procs recorded (`shm_files`). Only procs on this machine are signalled by pid: a pid
names a process on its own kernel and PID namespace (`machine_id`), and another host's
procs end with Monarch's stop and their host's job.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from monarch.actor import Actor, default_bootstrap_cmd, endpoint

from colocate.monarch_compat import BootstrapCommand
from colocate.resources.packing import ResourceError
from colocate.resources.proc_main import FORK_ENV
from colocate.shm_files import remove_files_of
from colocate.telemetry import process_runs

logger = logging.getLogger(__name__)

SLOT_ENV = "COLOCATE_SLOT"


def select(mesh: Any, **ranges: int | slice) -> Any:
    """`mesh.slice(**ranges)`, skipping dims the mesh does not have (this_host() has no
    "hosts" dim: its one host is always index 0)."""
    present = {dim: r for dim, r in ranges.items() if dim in mesh.extent.labels}
    return mesh.slice(**present) if present else mesh


def rank_of(mesh: Any, rank: int, procs_per_host: int) -> Any:
    """The one-proc slice of `mesh` (dims hosts x gpus) at `rank` in mesh order."""
    return select(mesh, hosts=rank // procs_per_host, gpus=rank % procs_per_host)


def _slot_env(slot: int, virtual: bool) -> dict[str, str]:
    """A slot proc's environment: its slot, and on a real GPU the slot to resolve to a GPU
    UUID when the proc starts (`gpus.run_on_slot_gpu`), plus torch_memory_saver's preload
    environment when this process runs in preload mode (`COLOCATE_TMS_HOOK_MODE=preload`):
    the hook must be in LD_PRELOAD before the proc starts. Its paths are this process's,
    as the bootstrap's Python is (hosts run the same installation)."""
    from colocate.memory.cuda import HOOK_MODE_ENV
    from colocate.resources.gpus import GPU_SLOT_ENV

    if virtual:
        return {SLOT_ENV: str(slot)}
    env = {SLOT_ENV: str(slot), GPU_SLOT_ENV: str(slot)}
    if os.environ.get(HOOK_MODE_ENV) == "preload":
        from colocate.memory import preload_env

        preload = preload_env()
        env.update({key: preload[key] for key in ("LD_PRELOAD", "LD_LIBRARY_PATH",
                                                  HOOK_MODE_ENV) if key in preload})
    return env


def bootstrap_command(env: Callable[[dict[str, int]], dict[str, str]],
                      fork_server: str | None = None) -> Callable[[Any], Any]:
    """A bootstrap command for each proc with `env(its coordinates)` added, set before the
    proc starts. Every proc starts through `proc_main.run`, then Monarch's bootstrap
    module; a GPU slot's proc (`GPU_SLOT_ENV` in its env) first gets CUDA_VISIBLE_DEVICES
    set to its GPU's UUID on the proc's own host (`gpus.run_on_slot_gpu`), so CUDA sees only
    that GPU. Given a `fork_server` (`zygote.address()`), every other proc is forked there."""
    from colocate.resources.gpus import GPU_SLOT_ENV

    def command(point: Any) -> BootstrapCommand:
        base = default_bootstrap_cmd()
        extra = env(dict(point))
        if fork_server and GPU_SLOT_ENV not in extra:
            extra[FORK_ENV] = fork_server
        args = list(base.args)
        if args[:1] != ["-m"] or len(args) < 2:
            raise ResourceError(
                f"cannot start a proc through colocate.resources.proc_main: Monarch's "
                f"bootstrap command is {base.program} {args}, not `python -m <module>`")
        args = ["-c", "from colocate.resources.proc_main import run; "
                f"run({args[1]!r}, gpu_slot={GPU_SLOT_ENV in extra})", *args[2:]]
        return BootstrapCommand(base.program, base.arg0, args, {**(base.env or {}), **extra})

    return command


def machine_id() -> str:
    """What a pid is relative to: this kernel's boot and this process's PID namespace (two
    Slurm nodes emulated on one machine share it; two real hosts do not)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return f"{boot.read().strip()}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:  # no /proc: name the host
        return os.uname().nodename


class ProcProbe(Actor):
    """Tells what a proc is: its pid, where that pid holds, and the slot environment it
    was started with."""

    @endpoint
    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "machine": machine_id(), "slot": os.environ.get(SLOT_ENV),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


@dataclass(frozen=True)
class SlotProcs:
    """Procs started by `spawn_slot_procs`: the proc mesh (dims hosts, gpus), the pids of
    its processes in mesh order, and those of them that run on this machine."""

    procs: Any
    pids: tuple[int, ...]
    here: tuple[int, ...]


async def spawn_slot_procs(host_mesh: Any, first_host: int, hosts: int, per_host: int,
                           slot_of: Callable[[int, int], int], virtual: bool,
                           fork_server: str | None = None) -> SlotProcs:
    """Start `per_host` procs on each of `hosts` hosts from `first_host` of `host_mesh`;
    the proc at (host h of these, proc p) gets slot `slot_of(h, p)`'s environment (a
    virtual slot's without a GPU), forked from `fork_server` when given. Returns once every
    proc answered with its pid."""

    def env(point: dict[str, int]) -> dict[str, str]:
        return _slot_env(slot_of(point.get("hosts", 0), point["gpus"]), virtual)

    procs = select(host_mesh, hosts=slice(first_host, first_host + hosts)).spawn_procs(
        per_host={"gpus": per_host}, bootstrap_command=bootstrap_command(env, fork_server))
    probe = procs.spawn("probe", ProcProbe)
    info = [value for _, value in (await probe.info.call()).items()]
    here = machine_id()
    return SlotProcs(procs, tuple(v["pid"] for v in info),
                     tuple(v["pid"] for v in info if v["machine"] == here))


async def stop_procs(procs: SlotProcs, grace_s: float, kill_first: bool = False) -> None:
    """Stop a proc mesh within `grace_s`, then kill what is left of it on this machine and
    remove the shared-memory files its procs recorded (`shm_files`). With `kill_first`
    (procs whose work is abandoned), kill them before Monarch's stop, which then does not
    wait on them."""
    if kill_first:
        _kill(procs.here)
    try:
        await asyncio.wait_for(procs.procs.stop(), grace_s)
    except Exception as err:  # a timeout, or procs that already died
        logger.warning("procs did not stop within %s s (%s); killing %s", grace_s, err,
                       list(procs.pids))
    _kill(procs.here)
    await ended(procs.here, grace_s)
    remove_files_of(procs.here)


def _kill(pids: tuple[int, ...]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


async def ended(pids: tuple[int, ...], timeout_s: float) -> None:
    """Wait (at most `timeout_s`) until none of `pids` runs: a killed process takes a
    moment to go."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while any(process_runs(pid) for pid in pids) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
