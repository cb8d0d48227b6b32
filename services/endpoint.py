"""`svc.<endpoint>`: a service's typed handle on one endpoint of its actor class.

    svc: Service[Generator] = await spawn_service(config, Generator)
    text = await svc.generate.route(prompt)       # typed as Generator.generate: str -> str
    texts = await svc.generate.fanout(prompt)     # list[str]
    async with svc.session():                     # the routes inside go to one replica
        await svc.generate.route(prompt)

`ServiceEndpoint[P, R]` keeps the endpoint's parameters `P` and result `R`, as Monarch's
`Endpoint(Protocol[P, R])` does for an actor mesh; with the mypy plugin
(`plugins = ["services.mypy_plugin"]`) `svc.generate` is typed from `Generator.generate`,
so a type checker flags a wrong argument: `route` takes exactly the endpoint's own
arguments, as Monarch's adverbs do (a session is a block, `Service.session`, not an
argument). `phase(svc.generate)` wakes on the service's replicas only the stages the
endpoint needs (`colocate.needs`). A service reaches its replicas through `route` (one
replica) and `fanout` (every awake one) only: Monarch's actor verbs (`call`, `call_one`,
`choose`, `broadcast`, `stream`) raise `AttributeError` saying so, and `endpoint_error`
tells a method that is not an `@endpoint` from a name that is not there.
"""

from __future__ import annotations

import difflib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

ACTOR_VERBS = ("call", "call_one", "choose", "broadcast", "stream", "rref")

Route = Callable[[str, tuple, dict], Awaitable[Any]]
Fanout = Callable[[str, tuple, dict], Awaitable[list[Any]]]


class ServiceEndpoint(Generic[P, R]):
    """`route` to one replica whose stages the endpoint needs are awake, and healthy
    (inside `async with svc.session():`, the session's replica); `fanout` to every such
    replica."""

    def __init__(self, service: str, name: str, route: Route, fanout: Fanout,
                 tenants: Callable[[], list[str]] = list,
                 stages: tuple[str, ...] | None = None) -> None:
        self.service, self.name = service, name
        self._route, self._fanout, self._tenants, self._stages = route, fanout, tenants, stages

    def tenant_names(self) -> list[str]:
        """The service's healthy replicas, by the arbiter's names."""
        return self._tenants()

    def stages(self) -> tuple[str, ...] | None:
        """The stages its calls need awake (`colocate.needs`; None: every stage)."""
        return self._stages

    async def route(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """The endpoint's result on one replica (inside `async with svc.session():`, the
        session's)."""
        return await self._route(self.name, args, kwargs)

    async def fanout(self, *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """The endpoint's results on every replica it can run on now, in replica order."""
        return await self._fanout(self.name, args, kwargs)

    if not TYPE_CHECKING:  # a type checker reports these as missing attributes instead

        def __getattr__(self, name: str) -> Any:
            if name in ACTOR_VERBS:
                raise AttributeError(
                    f"service {self.service!r}: {self.name}.{name}() is an actor verb; a "
                    f"service supports route() (one replica) and fanout() (every awake "
                    f"replica): use {self.name}.route(...) or {self.name}.fanout(...)")
            raise AttributeError(f"service endpoint {self.name!r} has no attribute {name!r}; "
                                 "it has route() and fanout()")

    def __repr__(self) -> str:
        return f"<endpoint {self.name!r} of service {self.service!r}>"


def endpoint_error(service: str, actor_class: type, endpoints: set[str],
                   name: str) -> AttributeError:
    """Why `svc.<name>` is no endpoint: a method of the class not marked `@endpoint`, or a
    name the class does not have (with the endpoints spelled closest to it)."""
    where = f"service {service!r} ({actor_class.__name__})"
    if callable(getattr(actor_class, name, None)):
        return AttributeError(
            f"{where}: {actor_class.__name__}.{name} is a method, not an @endpoint: a service "
            f"reaches only endpoints. Mark it @endpoint to route calls to it.")
    close = difflib.get_close_matches(name, sorted(endpoints), n=3)
    hint = (f"did you mean {' or '.join(map(repr, close))}?" if close else
            f"its endpoints: {', '.join(sorted(endpoints)) or 'none'}")
    return AttributeError(f"{where} has no endpoint {name!r}; {hint}")
