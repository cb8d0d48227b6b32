"""Entry point of every proc the runtime starts (slot procs and arbiter procs): set up
what must precede Monarch's bootstrap module, then run it as `python -m` would.

A GPU slot's proc first gets its GPU (`gpus.run_on_slot_gpu`). Every proc ends without the
interpreter's teardown: once Monarch's bootstrap returned, non-daemon threads were joined and
every atexit callback ran, the proc flushes its output and exits with the bootstrap's exit
code. With torch loaded, the teardown's garbage collections are most of a proc's stop
(py-spy finds the proc in `gc_collect_main` after its actors have stopped; figures:
bench/RESULTS.md, "A proc's stop"), for memory the system takes back anyway. Freezing the
heap (`gc.freeze`) would save the same time, but nanobind then prints its leak warnings at
every exit.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import runpy
import sys

FORK_ENV = "COLOCATE_FORK_SERVER"  # the socket of a fork server to start this proc from
_exit_code = 1  # what Python exits with after an uncaught exception


def run(module: str, gpu_slot: bool = False) -> None:
    """Run `module` as this proc's main module; with `gpu_slot`, on its slot's GPU; given a
    fork server (`zygote.FORK_ENV`), in a child of it that this process stands in for."""
    global _exit_code
    atexit.register(_exit_now)  # registered first, so it runs after every other callback
    fork_server = os.environ.pop(FORK_ENV, None)
    try:
        if fork_server and not gpu_slot:
            from colocate.resources.zygote import launch

            code = launch(fork_server, module)
            if code is not None:
                raise SystemExit(code)
        if gpu_slot:
            from colocate.resources.gpus import run_on_slot_gpu

            run_on_slot_gpu(module)
        else:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as end:
        _exit_code = end.code if isinstance(end.code, int) else int(end.code is not None)
        raise
    _exit_code = 0


def _exit_now() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # closed, or a broken pipe: exit all the same
            stream.flush()
    os._exit(_exit_code)
