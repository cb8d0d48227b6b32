"""Sessions in a generator: the rows of a `generate` call that continue a trajectory, and
the prefix counts every engine reports the same way.

A multi-turn rollout sends each turn of a trajectory to the same replica (a service
session) and names the trajectory per row (`generate(..., sessions=[...])`). The next
turn's prompt is the last turn's prompt, its completion and what came after (a tool's
answer): only the tokens after that prefix are new, and an engine that kept the prefix's
keys and values prefills only those. Whether it kept them depends on its cache (the torch
generator's per-session store, vLLM's prefix cache), so each row's `PrefixCounts` says
what was reused and what was computed again.

`SessionLedger` is the record both engines keep for that count: per session, the tokens
whose keys and values the engine computed for it as of its last call (its prompt and all
but the last sampled token: the last one is never fed). A new prompt's tokens that match
that record from the start could have been reused; those the cache gave back are
`reused`, the others `recomputed`. The ledger holds token ids only (no tensors), bounded
by a count of sessions, oldest dropped first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from colocate.engines.sampling import PrefixCounts

LEDGER_SESSIONS = 4096  # sessions whose token record a ledger keeps


def check_sessions(sessions: Sequence[str | None] | None, count: int) -> list[str | None]:
    """A call's `sessions` as a list of `count` (None: the row has no session), checked:
    one per prompt, non-empty strings, no session on two rows (a session is one
    trajectory, and one row of a call continues it)."""
    if sessions is None:
        return [None] * count
    sessions = list(sessions)
    if len(sessions) != count:
        raise ValueError(f"sessions has {len(sessions)} entries for {count} prompts: give one "
                         "per prompt (None for a row without a session)")
    rows: dict[str, int] = {}
    for i, session in enumerate(sessions):
        if session is None:
            continue
        if not isinstance(session, str) or not session:
            raise ValueError(f"sessions[{i}] = {session!r}: a session id is a non-empty str "
                             "(or None for a row without one)")
        if session in rows:
            raise ValueError(f"session {session!r} names rows {rows[session]} and {i}: a "
                             "session is one trajectory, continued by one row of a call; "
                             "give the other row a session of its own")
        rows[session] = i
    return sessions


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens `a` and `b` share from the start."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def reusable(tokens: Sequence[int], known: Sequence[int]) -> int:
    """Of `tokens` (a row to prefill), how many lead with tokens in `known` (whose keys
    and values were computed before): at most all but the last, which is always computed
    (its logits give the first new token)."""
    return min(common_prefix(tokens, known), len(tokens) - 1)


class SessionLedger:
    """Per session, the tokens whose keys and values the engine computed for it by its
    last call; the running totals of every row's `PrefixCounts`."""

    def __init__(self, max_sessions: int = LEDGER_SESSIONS) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions={max_sessions}: must be >= 1")
        self.max_sessions = max_sessions
        self._tokens: OrderedDict[str, list[int]] = OrderedDict()
        self._totals = PrefixCounts()

    def known(self, session: str | None) -> list[int]:
        """The tokens `session` had computed by its last call (none: a new session)."""
        return self._tokens.get(session, []) if session is not None else []

    def count(self, session: str | None, tokens: Sequence[int], reused: int) -> PrefixCounts:
        """The counts of a row that prefilled `tokens` taking `reused` of them from the
        cache (vLLM's cache may give more than the session computed: another request's
        equal prefix), added to the totals."""
        reused = max(0, min(reused, len(tokens)))
        could = reusable(tokens, self.known(session)) if tokens else 0
        counts = PrefixCounts(len(tokens), reused, max(0, could - reused))
        self._totals = self._totals + counts
        return counts

    def record(self, session: str, tokens: Sequence[int]) -> None:
        """`session` has now computed the keys and values of `tokens` (its last call's row:
        prompt and all but the last sampled token)."""
        self._tokens.pop(session, None)
        self._tokens[session] = list(tokens)
        while len(self._tokens) > self.max_sessions:
            self._tokens.popitem(last=False)

    def end(self, session: str) -> None:
        """Forget `session` (a later row with its name starts a new one)."""
        self._tokens.pop(session, None)

    def totals(self, reset: bool = False) -> PrefixCounts:
        """Every row's counts summed since the start (or the last reset); `reset` starts
        them again from zero."""
        totals = self._totals
        if reset:
            self._totals = PrefixCounts()
        return totals

    def __len__(self) -> int:
        return len(self._tokens)


def computed_tokens(tokens: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens whose keys and values a row computed: what it prefilled, `tokens`, and
    each sampled token but the last (a sampled token is fed, and so computed, only to
    sample the next)."""
    return list(tokens) + list(sampled[:-1])
