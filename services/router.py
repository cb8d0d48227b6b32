"""Which replica takes a call: a session's own replica, else the configured router's pick.

Every service routes through one `SessionRouter` wrapping the router that `ServiceConfig.router`
names ("round_robin" or "least_loaded"): a call with a session goes to the replica that
session last used while that replica can take it, and otherwise (no session, or its replica
is asleep, failed or gone) to the fallback's pick, which the session then keeps. Session
stickiness lives here and nowhere else.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
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


class SessionRouter:
    """Sessions stick to a replica; the rest (and a session whose replica cannot take the
    call) goes to `fallback`."""

    def __init__(self, fallback: Router) -> None:
        self.fallback = fallback
        self.sessions: dict[str, int] = {}  # session -> the index of its replica

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
