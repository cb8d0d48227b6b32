"""`ComputeThread`: an engine actor's torch work on a thread of its own, so that torch's
allocation churn has a malloc arena of its own.

glibc's malloc gives each thread an arena. Monarch runs an actor's endpoints on its
runtime's threads, which also allocate Monarch's own per-message state, some of which it
keeps for the life of the proc (hyperactor's actor and port identifiers, its per-port
maps). Sprinkled among a train step's freed activations (blocks of 128 KiB-1 MiB, which
glibc keeps on the heap), those survivors pin holes that never coalesce: on Monarch's
threads the arena grows by a hole of a page or more every few steps, without end, and
every sleep's `malloc_trim(0)` (`memory.release_cached`) walks and madvises each one, so
the handoff gets slower the longer the run (bench/RESULTS.md, "A thread of its own for
engine work", has the figures). On a thread of the actor's own, the churn's arena holds
only the churn and stops growing. (glibc makes at most 8 arenas a core, then threads
share them: a Monarch proc has about 12 threads, so on a 1-core machine set
`MALLOC_ARENA_MAX` higher for the procs.)

One thread per actor (not per process), so actors sharing a proc run side by side as
they do on Monarch's threads, and ranks of different actors cannot wait on each other's
collectives. The thread is a daemon: a call that hangs does not keep the proc from
exiting. `threads` sets torch's intra-op threads for this thread alone (OpenMP keeps the
count per thread; the process's other threads keep theirs).
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")

_Job = tuple[concurrent.futures.Future, Callable[..., Any], tuple, dict]


class ComputeThread:
    """Runs calls one at a time on one thread of its own; `run` waits for the result (or
    raises what the call raised), `submit` queues one and returns its future; both carry
    the caller's current CUDA device over."""

    def __init__(self, name: str, threads: int | None = None) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=_serve, args=(self._jobs, threads), name=name,
                                       daemon=True)
        self.thread.start()
        weakref.finalize(self, self._jobs.put, None)  # the thread ends with its owner

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if threading.current_thread() is self.thread:  # a call from within: run it here
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any
               ) -> concurrent.futures.Future[T]:
        """Queue a call without waiting: its future gives the result (or the error)."""
        if torch.cuda.is_initialized():  # the current device is per thread
            fn, args = _on_device, (torch.cuda.current_device(), fn, *args)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, fn, args, kwargs))
        return future


def _on_device(device: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    torch.cuda.set_device(device)
    return fn(*args, **kwargs)


def _serve(jobs: queue.SimpleQueue[_Job | None], threads: int | None) -> None:
    if threads is not None:
        torch.set_num_threads(threads)
    while (job := jobs.get()) is not None:
        future, fn, args, kwargs = job
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as err:  # handed to the caller, which raises it
            future.set_exception(err)
        del job, future, fn, args, kwargs  # hold nothing of the call between calls
