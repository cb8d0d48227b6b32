"""The torch generator's per-session KV prefix cache, and batches that start from it.

`SessionKV` keeps, per session, the keys and values of the tokens the session's last call
computed (`sessions.computed_tokens`), so that the next turn of a trajectory prefills only
what came after them. It is bounded by bytes and by sessions, the least recently used
session dropped first; a session too large for the bound is not kept. Its tensors are part
of the generator's declared working memory (`TorchGenerator` adds the bound to it), and
the generator empties it whenever it sleeps or loads weights (keys and values computed
with the old weights would be wrong).

`prefilled_cache` starts a batch's `DynamicCache` from the rows' cached prefixes, each row
left-padded to the longest; the row's new tokens follow, left-padded too, so a row's mask
may have a gap between its prefix and its new tokens (positions come from the mask).
`row_kv` takes one row's keys and values back out of a finished batch, without the gaps.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

LayerKV = tuple[list[torch.Tensor], list[torch.Tensor]]  # per layer [kv_heads, n, head_dim]


@dataclass
class CachedPrefix:
    """A session's tokens and, per layer, their keys and values."""

    tokens: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


class SessionKV:
    """Per session, a `CachedPrefix`, within `max_bytes` and `max_sessions` (least recently
    used dropped first). `token_bytes`: what one token's keys and values take, every layer.
    With `max_bytes=0` it keeps nothing."""

    def __init__(self, max_bytes: int, max_sessions: int, token_bytes: int) -> None:
        if max_bytes < 0 or max_sessions < 1 or token_bytes < 1:
            raise ValueError(f"SessionKV(max_bytes={max_bytes}, max_sessions={max_sessions}, "
                             f"token_bytes={token_bytes}): need max_bytes >= 0, "
                             "max_sessions >= 1, token_bytes >= 1")
        self.max_bytes, self.max_sessions, self.token_bytes = max_bytes, max_sessions, token_bytes
        self._entries: OrderedDict[str, CachedPrefix] = OrderedDict()
        self.nbytes = 0  # held now
        self.evicted = 0  # sessions dropped to stay within the bounds

    def get(self, session: str) -> CachedPrefix | None:
        entry = self._entries.get(session)
        if entry is not None:
            self._entries.move_to_end(session)
        return entry

    def put(self, session: str, tokens: Sequence[int], extract: Callable[[], LayerKV]) -> bool:
        """Keep `tokens` for `session`, in place of what it had: older sessions are dropped
        first to make room, then `extract()` gives the keys and values (so that they are
        never held beyond the bound). Returns whether they were kept (not when they alone
        pass `max_bytes`)."""
        self.drop(session)
        size = len(tokens) * self.token_bytes
        if not tokens or size > self.max_bytes:
            return False
        while self._entries and (self.nbytes + size > self.max_bytes
                                 or len(self._entries) >= self.max_sessions):
            self._remove(next(iter(self._entries)))
            self.evicted += 1
        keys, values = extract()
        entry = CachedPrefix(list(tokens), keys, values)
        self._entries[session] = entry
        self.nbytes += entry.nbytes
        return True

    def drop(self, session: str) -> None:
        if session in self._entries:
            self._remove(session)

    def clear(self) -> int:
        """Drop every session; returns the bytes they held."""
        freed = self.nbytes
        self._entries.clear()
        self.nbytes = 0
        return freed

    def _remove(self, session: str) -> None:
        self.nbytes -= self._entries.pop(session).nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session: object) -> bool:
        return session in self._entries


@dataclass
class BatchRow:
    """A row to generate: the tokens to prefill (prompt, and a continued completion's tokens
    so far), the most it may sample, and its first `reuse` tokens' keys and values from
    the session cache."""

    tokens: list[int]
    budget: int
    cached: CachedPrefix | None = None
    reuse: int = 0


def prefilled_cache(cache, prefixes: Sequence[CachedPrefix | None], reuse: Sequence[int],
                    width: int) -> None:
    """Fill the empty `cache` (a `DynamicCache`) with each row's first `reuse[i]` cached
    keys and values, right-aligned in `width` columns (the rest zeros, to be masked)."""
    first = next(p for p, n in zip(prefixes, reuse, strict=True) if p is not None and n)
    for layer_index, layer in enumerate(cache.layers):
        heads, _, dim = first.keys[layer_index].shape
        like = first.keys[layer_index]
        keys = like.new_zeros(len(prefixes), heads, width, dim)
        values = like.new_zeros(len(prefixes), heads, width, dim)
        for row, (prefix, n) in enumerate(zip(prefixes, reuse, strict=True)):
            if prefix is not None and n:
                keys[row, :, width - n:] = prefix.keys[layer_index][:, :n]
                values[row, :, width - n:] = prefix.values[layer_index][:, :n]
        layer.update(keys, values)


def row_kv(cache, row: int, columns: torch.Tensor) -> LayerKV:
    """Row `row`'s keys and values at `columns` of a batch's `cache`, copied out."""
    keys = [layer.keys[row].index_select(-2, columns) for layer in cache.layers]
    values = [layer.values[row].index_select(-2, columns) for layer in cache.layers]
    return keys, values


def plain_layers(cache) -> bool:
    """Whether every layer of `cache` keeps all its tokens' keys and values (a sliding
    window layer keeps its last ones only: its rows cannot be cut out and reused)."""
    from transformers.cache_utils import DynamicLayer

    return all(type(layer) is DynamicLayer for layer in cache.layers)
