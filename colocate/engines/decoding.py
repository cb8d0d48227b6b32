"""Continuous batching for the torch generator: calls made at once feed one running decode
loop, whose rows join and leave as they come.

A call's rows queue (`ContinuousBatcher.add`); a row joins the running batch before the
next decoding step that has a free slot (of `slots`), its tokens prefilled on their own,
and leaves at its stop token or its budget; the call's future is set when its last row has
left. A call whose `stop` answers True before a step returns each row it has unfinished
(a row that had not joined: no tokens), as the whole-batch path does.

Same seed, same run, whatever the calls' timing: a row's tokens and log-probabilities
depend on the row alone, never on its companions or its slot, so
- each row samples with its own `torch.Generator`, seeded with its call's seed plus its
  index in the call (`row_seed`: request i of a spread call is seeded with seed + i, so
  the same row gets the same stream however the rows are split into calls);
- a joining row is prefilled alone (shape [1, its new tokens]);
- every decoding step runs all `slots` rows (empty ones padded) against a KV cache of
  `length` columns per slot (`SlotCache`), each row's keys at its own positions from
  column 0 and an additive mask over the rest: the shapes never change, and at a fixed
  shape a row's matmuls and attention are bitwise independent of the other rows (checked
  on CPU, torch 2.13; a varying row count or key width is not: the kernels block
  differently), with one intra-op thread on CPU (with two, a row's log-probabilities
  differed in the last bit with its companions on an AMD EPYC, not on another machine).
The price of that: every step computes `slots` rows and attends over `length` columns,
however few rows run and however short they are.

Transformers' own continuous batching (`generation.continuous_batching`, 5.19) is not used:
it samples every request from one shared RNG (one seed per manager) over packed batches
whose shapes follow their companions, so a request's tokens change with the others
(checked: seed 7, a request alone and beside a second one got other tokens), and it
cannot hand a preempted request's tokens back or start from our sessions' keys and values.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from colocate.engines.compute_thread import ComputeThread
from colocate.engines.draw import draw
from colocate.engines.kv_sessions import BatchRow, CachedPrefix, LayerKV
from colocate.engines.sampling import Completion, PrefixCounts, SamplingParams


def row_seed(seed: int, index: int) -> int:
    """The seed of row `index` of a call seeded `seed`."""
    return (seed + index) % (1 << 63)


class SlotCache:
    """Keys and values of `slots` rows, `length` columns each, per layer: the cache object a
    transformers model's attention layers write into (`update`, the one call they make),
    where each row's token at position p sits at column p of its slot. `at` says where the
    next forward writes: one slot from a column on (a prefill), or every slot at its own
    column (a decoding step)."""

    def __init__(self, config, slots: int, length: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        shape = (slots, kv_heads, length, dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device)
                     for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self._every = torch.arange(slots, device=device)
        self._slot: int | None = None
        self._columns: torch.Tensor | int = 0

    def at(self, slot: int | None, columns: torch.Tensor | int) -> None:
        """The next forward writes slot `slot` from column `columns` (an int) on, or, with
        `slot=None`, every slot at its own column (`columns`, one per slot)."""
        self._slot, self._columns = slot, columns

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer: int,
               cache_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self._slot is None:  # a decoding step: [slots, heads, 1, dim]
            self.keys[layer][self._every, :, self._columns] = keys[:, :, 0]
            self.values[layer][self._every, :, self._columns] = values[:, :, 0]
            return self.keys[layer], self.values[layer]
        s, start = self._slot, self._columns
        self.keys[layer][s, :, start:start + keys.shape[2]] = keys[0]
        self.values[layer][s, :, start:start + keys.shape[2]] = values[0]
        return self.keys[layer][s:s + 1], self.values[layer][s:s + 1]

    def fill(self, slot: int, prefix: CachedPrefix, count: int) -> None:
        """Slot `slot`'s first `count` columns from a session's cached keys and values."""
        for layer, (keys, values) in enumerate(zip(prefix.keys, prefix.values, strict=True)):
            self.keys[layer][slot, :, :count] = keys[:, :count]
            self.values[layer][slot, :, :count] = values[:, :count]

    def row_kv(self, slot: int, count: int) -> LayerKV:
        """Slot `slot`'s first `count` columns' keys and values, copied out."""
        return ([k[slot, :, :count].clone() for k in self.keys],
                [v[slot, :, :count].clone() for v in self.values])


@dataclass(eq=False)  # one call: identity
class Request:
    """One call: its rows' tokens to prefill (`rows[i]`: None, nothing to generate), its
    sampling, each row's session, its `stop`, and what `finish` makes of each row's new
    completion (its earlier tokens and versions added)."""

    rows: list[tuple[list[int], int] | None]  # per row: tokens to prefill, budget
    params: SamplingParams
    seed: int
    sessions: list[str | None]
    stop: Callable[[], bool] | None
    out: list[Completion | None]
    finish: Callable[[int, Completion], Completion]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    left: int = 0  # rows not ended yet

    def __post_init__(self) -> None:
        self.left = sum(row is not None for row in self.rows)


@dataclass(eq=False)  # one row in a slot: identity (found by `list.index`)
class _Live:
    """A row in a slot: its call, its index there, what it prefilled, its generator, the
    column its next token goes to, and its tokens so far."""

    request: Request
    index: int
    row: BatchRow
    rng: torch.Generator
    column: int = 0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class ContinuousBatcher:
    """The running batch of a model (see module): `add` a call's `Request` (holding
    `gate`), whose future is set when its rows are done. Its loop runs on a thread of its
    own while there are rows, and lets go of its cache when there are none.

    The generator's state is reached through its callbacks, each called holding `gate`:
    `prepare(tokens, budget, session)` the row to prefill (with its session's keys),
    `account(session, row, completion, extract)` a row that ended (its prefix counts),
    `done(request)` a call all of whose rows ended (before its future is set)."""

    def __init__(self, model: torch.nn.Module, slots: int, length: int,
                 device: torch.device, name: str, gate: threading.Condition,
                 prepare: Callable[[list[int], int, str | None], BatchRow],
                 account: Callable[[str | None, BatchRow, Completion,
                                    Callable[[], LayerKV]], PrefixCounts],
                 done: Callable[[Request], None]) -> None:
        self.model, self.slots, self.length, self.device = model, slots, length, device
        self.gate, self.prepare, self.account, self.done = gate, prepare, account, done
        # one intra-op thread on CPU: with two, a row's log-probabilities differed in the
        # last bit with its companions (AMD EPYC, torch 2.13; tokens equal), one is bitwise
        self.thread = ComputeThread(name, threads=1 if device.type == "cpu" else None)
        self.pending: list[Request] = []  # added, not yet seen by the loop (under gate)
        self.driving = False  # whether the loop runs (under gate)
        self.waiting: deque[tuple[Request, int]] = deque()  # rows not yet joined
        self.live: list[_Live | None] = [None] * slots
        self.cache: SlotCache | None = None
        self.valid: torch.Tensor | None = None  # [slots, length]: columns attended
        self.steps = 0  # decoding steps run
        self.most_live = 0  # the most rows one step decoded

    def add(self, request: Request) -> None:
        """Queue `request`'s rows (the caller holds `gate`)."""
        self.pending.append(request)
        if not self.driving:
            self.driving = True
            self.thread.submit(self._drive)

    @torch.no_grad()
    def _drive(self) -> None:
        try:
            while self._admit():
                self._preempt()
                self._join()
                self._decode()
        except BaseException as err:  # every call in flight fails with it
            self._fail(err)

    def _admit(self) -> bool:
        """Take the calls added since; False (and the loop ends) when no row is left."""
        with self.gate:
            for request in self.pending:
                self.waiting.extend((request, i) for i, row in enumerate(request.rows)
                                    if row is not None)
            self.pending.clear()
            if self.waiting or any(self.live):
                return True
            self.driving, self.cache, self.valid = False, None, None
            return False

    def _preempt(self) -> None:
        """The rows of calls whose `stop` answers True end now, unfinished."""
        requests = {id(r): r for r in [*(live.request for live in self.live if live),
                                        *(r for r, _ in self.waiting)]}
        stopped = {key for key, r in requests.items() if r.stop is not None and r.stop()}
        if not stopped:
            return
        for live in self.live:
            if live is not None and id(live.request) in stopped:
                self._leave(live, preempted=True)
        kept: deque[tuple[Request, int]] = deque()
        for request, index in self.waiting:
            if id(request) in stopped:  # nothing computed: no prefix counts
                self._end(request, index, Completion([], finished=False), PrefixCounts())
            else:
                kept.append((request, index))
        self.waiting = kept

    def _join(self) -> None:
        """Waiting rows take the free slots, in the order they came, each prefilled alone
        (its first token drawn from the prefill)."""
        while self.waiting and None in self.live:
            request, index = self.waiting.popleft()
            tokens, budget = request.rows[index]  # type: ignore[misc]
            with self.gate:
                row = self.prepare(tokens, budget, request.sessions[index])
            rng = torch.Generator(device=self.device)
            rng.manual_seed(row_seed(request.seed, index))
            slot = self.live.index(None)
            live = self.live[slot] = _Live(request, index, row, rng)
            self._take(live, slot, self._prefill(slot, live)[0])

    def _prefill(self, slot: int, live: _Live) -> torch.Tensor:
        """Row `live`'s tokens into slot `slot` (its session's cached prefix copied, the
        rest computed alone): the logits after its last token."""
        if self.cache is None:
            dtype = next(self.model.parameters()).dtype
            self.cache = SlotCache(self.model.config, self.slots, self.length, dtype,
                                   self.device)
            self.valid = torch.zeros(self.slots, self.length, dtype=torch.bool,
                                     device=self.device)
        row = live.row
        if row.reuse:
            self.cache.fill(slot, row.cached, row.reuse)  # type: ignore[arg-type]
        row.cached = None  # copied: the session cache may let it go (and its memory)
        new = row.tokens[row.reuse:]
        start, n = row.reuse, len(new)
        positions = torch.arange(start, start + n, device=self.device)
        columns = torch.arange(self.length, device=self.device)
        allowed = columns[None, :] <= positions[:, None]  # causal, from column 0
        self.valid[slot] = False  # type: ignore[index]
        self.valid[slot, :start + n] = True  # type: ignore[index]
        live.column = start + n
        self.cache.at(slot, start)
        return self._logits(torch.tensor([new], device=self.device), allowed[None],
                            positions[None])

    def _decode(self) -> None:
        """One decoding step of every slot (the empty ones padded), each live row's last
        token fed at its own column."""
        running = [(slot, live) for slot, live in enumerate(self.live) if live is not None]
        if not running:
            return
        tokens = torch.zeros(self.slots, 1, dtype=torch.long, device=self.device)
        columns = torch.zeros(self.slots, dtype=torch.long, device=self.device)
        valid = self.valid.clone()  # type: ignore[union-attr]
        valid[:, 0] = True  # an empty slot attends its column 0 (any finite value)
        for slot, live in running:
            tokens[slot, 0], columns[slot] = live.tokens[-1], live.column
            self.valid[slot, live.column] = True  # type: ignore[index]
            valid[slot] = self.valid[slot]  # type: ignore[index]
        self.cache.at(None, columns)  # type: ignore[union-attr]
        logits = self._logits(tokens, valid[:, None], columns[:, None])
        self.steps += 1
        self.most_live = max(self.most_live, len(running))
        for slot, live in running:
            live.column += 1
            self._take(live, slot, logits[slot])

    def _logits(self, tokens: torch.Tensor, allowed: torch.Tensor, positions: torch.Tensor
                ) -> torch.Tensor:
        """The next-token logits [B, V] after `tokens` [B, T] at `positions`, attending the
        cache columns `allowed` [B, T, length]."""
        dtype = next(self.model.parameters()).dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
        mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]  # [B, 1, T, L]
        out = self.model(input_ids=tokens, attention_mask=mask, position_ids=positions,
                         past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()

    def _take(self, live: _Live, slot: int, logits: torch.Tensor) -> None:
        """Row `live`'s next token, drawn from its `logits` [V] with its own generator;
        it leaves at a stop token or at its budget."""
        params = live.request.params
        token, logprob = draw(logits[None], params, live.rng)
        live.tokens.append(int(token[0]))
        live.logprobs.append(float(logprob[0]))
        if live.tokens[-1] in params.stop_token_ids or len(live.tokens) >= live.row.budget:
            self._leave(live)

    def _leave(self, live: _Live, preempted: bool = False) -> None:
        """Row `live` leaves its slot: its completion (unfinished when `preempted` before
        its end), its session's keys and values offered to the session cache."""
        slot = self.live.index(live)
        self.live[slot] = None
        stopped = bool(live.tokens) and live.tokens[-1] in live.request.params.stop_token_ids
        ended = stopped or len(live.tokens) >= live.row.budget
        completion = Completion(live.tokens, live.logprobs, stopped=stopped,
                                finished=ended or not preempted)
        cache, computed = self.cache, len(live.row.tokens) + len(live.tokens) - 1
        with self.gate:
            prefix = self.account(live.request.sessions[live.index], live.row, completion,
                                  lambda: cache.row_kv(slot, computed))  # type: ignore[union-attr]
        self._end(live.request, live.index, completion, prefix)

    def _end(self, request: Request, index: int, completion: Completion,
             prefix: PrefixCounts) -> None:
        """Row `index` of `request` ended with `completion`; the call's result once all did."""
        completion.prefix = prefix
        request.out[index] = request.finish(index, completion)
        request.left -= 1
        if request.left == 0:
            with self.gate:
                self.done(request)
            request.future.set_result(request.out)

    def _fail(self, err: BaseException) -> None:
        """The loop failed: every call it holds fails with `err`, and it starts afresh."""
        with self.gate:
            requests = {id(r): r for r in [*self.pending, *(r for r, _ in self.waiting),
                                            *(live.request for live in self.live if live)]}
            self.pending.clear()
            self.waiting.clear()
            self.live = [None] * self.slots
            self.driving, self.cache, self.valid = False, None, None
            for request in requests.values():
                self.done(request)
        for request in requests.values():
            request.future.set_exception(err)


def queued_rows(before: Sequence[Completion | None], prompts: Sequence[Sequence[int]],
                max_new_tokens: int) -> list[tuple[list[int], int] | None]:
    """Per row of a call, the tokens to prefill and the budget left (None: a finished
    completion passed back, nothing to generate)."""
    rows: list[tuple[list[int], int] | None] = []
    for prompt, done in zip(prompts, before, strict=True):
        if done is not None and done.finished:
            rows.append(None)
        else:
            earlier = done.tokens if done is not None else []
            rows.append((list(prompt) + earlier, max_new_tokens - len(earlier)))
    return rows
