"""Which replica takes a call: a session's own replica, else the configured router's pick.

Every service routes through one `SessionRouter` wrapping the router that `ServiceConfig.router`
names ("round_robin" or "least_loaded"): a call with a session goes to the replica that
session last used while that replica can take it, and otherwise (no session, or its replica
is asleep, failed or gone) to the fallback's pick, which the session then keeps. Session
stickiness lives here and nowhere else.

A session is a block, `async with svc.session():` (`SessionRouter.session`): the calls
routed inside it, in its task and in the tasks started there (they copy its context), are
the session's, so `route` takes only the endpoint's own arguments. Each service's router
keeps its own session in the context, so the sessions of two services nest apart.

A session's end is final: a call routed after it (from a task started inside the block
that outlived it) goes where the fallback sends it and is remembered nowhere. A session
the caller names, `svc.session(id="traj-7")`, is the caller's to keep: its blocks (one per
turn of a trajectory, in any task, across steps) resume it on its replica, and it ends only
with `end(id)`; the caller ends it when the trajectory ends.
"""

from __future__ import annotations

import contextvars
import itertools
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Protocol

from services.replica import Replica


class Router(Protocol):
    def pick(self, candidates: Sequence[Replica]) -> Replica: ...


class RoundRobin:
    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(self, candidates: Sequence[Replica]) -> Replica:
        return candidates[next(self._turn) % len(candidates)]


class LeastLoaded:
    def pick(self, candidates: Sequence[Replica]) -> Replica:
        return min(candidates, key=lambda r: (r.in_flight, r.index))


ROUTERS: dict[str, type[Router]] = {"round_robin": RoundRobin, "least_loaded": LeastLoaded}


# the session of each router (each service) in this context, set by `SessionRouter.session`
_sessions: contextvars.ContextVar[Mapping[SessionRouter, str]] = \
    contextvars.ContextVar("service_sessions")


class SessionRouter:
    """Sessions stick to a replica; the rest (and a session whose replica cannot take the
    call) goes to `fallback`."""

    def __init__(self, fallback: Router) -> None:
        self.fallback = fallback
        self.sessions: dict[str, int] = {}  # session -> the index of its replica
        self._open: set[str] = set()  # the sessions not ended: only they are remembered
        self._ids = itertools.count()

    @asynccontextmanager
    async def session(self, prefix: str, id: str | None = None) -> AsyncIterator[str]:
        """A session for the calls routed inside the block (see module): a new one (its
        id: `prefix`-n), ended with the block; or the caller's own `id`, begun or resumed,
        which outlives the block until `end(id)`."""
        if id is not None and (not isinstance(id, str) or not id):
            raise ValueError(f"session id {id!r}: give a non-empty str (the caller's own "
                             "name for it, e.g. a trajectory's id), or None for a new one")
        session = f"{prefix}-{next(self._ids)}" if id is None else id
        self._open.add(session)
        token = _sessions.set({**_sessions.get({}), self: session})
        try:
            yield session
        finally:
            _sessions.reset(token)
            if id is None:
                self.end(session)

    def current(self) -> str | None:
        """The session of the innermost `session` block of this router around the caller
        (None: outside any)."""
        return _sessions.get({}).get(self)

    def pick(self, candidates: Sequence[Replica], session: str | None = None) -> Replica:
        if session is not None:
            mine = self.sessions.get(session)
            for replica in candidates:
                if replica.index == mine:
                    return replica
        replica = self.fallback.pick(candidates)
        if session in self._open:  # an ended one is not brought back
            self.sessions[session] = replica.index
        return replica

    def end(self, session: str) -> None:
        """End `session` for good: forget its replica; calls routed in it later are routed
        as without one (see module)."""
        self._open.discard(session)
        self.sessions.pop(session, None)


def make_router(name: str) -> SessionRouter:
    """The session router over the router `name` (a `ServiceConfig.router` value)."""
    return SessionRouter(ROUTERS[name]())
