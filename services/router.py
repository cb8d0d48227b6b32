"""Which replica takes a call that has no session (or whose session must move).

Sessions stick to their replica in every case (see `Service.session`); "sticky" names the
session-sticky service whose other calls go to the least loaded replica.
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


def make_router(name: str) -> Router:
    return {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "sticky": LeastLoaded}[name]()
