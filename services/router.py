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
        self._ids = itertools.count()

    @asynccontextmanager
    async def session(self, prefix: str) -> AsyncIterator[str]:
        """A session (its id: `prefix`-n) for the calls routed inside the block (see
        module); the router forgets it after."""
        session = f"{prefix}-{next(self._ids)}"
        token = _sessions.set({**_sessions.get({}), self: session})
        try:
            yield session
        finally:
            _sessions.reset(token)
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
        if session is not None:
            self.sessions[session] = replica.index
        return replica

    def end(self, session: str) -> None:
        """Forget `session` (its `Service.session` block ended)."""
        self.sessions.pop(session, None)


def make_router(name: str) -> SessionRouter:
    """The session router over the router `name` (a `ServiceConfig.router` value)."""
    return SessionRouter(ROUTERS[name]())
