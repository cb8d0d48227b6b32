"""The tenants on Monarch: the `TenantActor` base class (the per-host `Arbiter` is in host.py).

A `TenantActor` is a colocated actor (trainer, generator...) whose memory lives under
`colocate.memory` tags, one per stage. Its sleep, wake and describe endpoints are its
tenancy's (`self.tenancy`: a `TaggedTenant` over `stages`, or the one its engine hands
over); a subclass may override them (and `receive`). Tenant endpoints are sync, so a
subclass's endpoints must be sync too (Monarch does not mix the two in one class).

A switch reaches a proc as one plan (`run_plan`, plan.py), sent to one tenant actor of
the proc, which carries it out against every tenant of its process by calling their own
sleep, wake and receive. The guarantee of the one-message-per-call design is kept: a
tenant is never paused or woken while one of its calls runs. The plan is an endpoint, so
it runs after the receiving tenant's calls already in its mailbox; and every endpoint of
a `TenantActor` runs holding its tenant's busy lock (a re-entrant lock per actor, taken
around the endpoint's method: each actor runs its sync endpoints one at a time on its
own thread anyway), which the plan takes before calling into another tenant of the
process. So each tenant's sleep or wake runs once its call in flight has drained, and
no call of it starts until the step is done. (Calls of a tenant about to sleep are
drained by its services before the switch is sent: `resources.switching`.)

Because of that lock a tenant cannot be asked to stop a running call through one of its
own endpoints: a switch with preemption reaches it through a `Preempter`, a small actor
beside it on the same procs, which calls the tenant's `preempt` hook from its own thread
(see `preempt.py`).

`remote_errors()` lets a caller catch the runtime's own errors (`TagPausedError`...) around
a direct actor call, which Monarch delivers wrapped in its `ActorError`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import pickle
import threading
import traceback
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, ClassVar

import torch
from monarch.actor import Actor, ActorError, current_actor_name, endpoint

from colocate import memory
from colocate.arbiter.errors import ArbiterError
from colocate.arbiter.plan import Plan, PlanResult, run_here
from colocate.arbiter.preempt import HONOURED, LATE, UNSUPPORTED, Preemption
from colocate.arbiter.tenant import TaggedTenant, Tenancy, TenantInfo
from colocate.memory.capacity import from_cuda_oom
from colocate.monarch_compat import EndpointProperty, endpoint_function, set_endpoint_function


class _KeepsInitError(type(Actor)):
    """Metaclass of `TenantActor`: an exception from a tenant's `__init__` is kept on a bare
    instance, for its `started()` endpoint to raise, instead of failing the actor.

    Monarch 0.7.0 refuses every later spawn on a proc where an actor failed ("Cannot spawn
    new actors on mesh with supervision events": meta-pytorch/monarch#1454; an `__init__`
    failure is an actor failure since monarch#2049), so one tenant's bad argument would
    take its procs away from every tenant spawned after it. Kept, the error reaches the
    spawner as an ordinary endpoint error, and the actor is stopped cleanly.
    """

    def __init__(cls, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _serialize_endpoints(cls)
        _document_endpoints(cls)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        try:
            instance = super().__call__(*args, **kwargs)
        except Exception as err:
            traceback.clear_frames(err.__traceback__)  # lets go of what __init__ made
            instance = cls.__new__(cls)
            instance.__dict__["_init_error"] = err
            return instance
        with contextlib.suppress(Exception):  # outside an actor it has no name: started()
            _HERE[instance.tenant_name] = instance  # for the plans run in this process
        return instance


_BUSY_MADE = threading.Lock()  # guards the first creation of each tenant's busy lock


def _busy_lock(actor: Any) -> threading.RLock:
    """The busy lock of a tenant actor: held while any of its endpoints runs."""
    lock = actor.__dict__.get("_busy")
    if lock is None:
        with _BUSY_MADE:
            lock = actor.__dict__.setdefault("_busy", threading.RLock())
    return lock


def _serialize_endpoints(cls: type) -> None:
    """Make each sync endpoint defined by `cls` run holding its actor's busy lock."""
    for value in vars(cls).values():
        if not isinstance(value, EndpointProperty):
            continue
        method = endpoint_function(value)
        if method not in _HOLDING_BUSY and not inspect.iscoroutinefunction(method):
            set_endpoint_function(value, _holding_busy(method))


def _holding_busy(method: Any) -> Any:
    preempts = getattr(method, "__colocate_call__", None) is not None \
        and method.__colocate_call__.preemptible

    @functools.wraps(method)
    def holding(self: Any, *args: Any, **kwargs: Any) -> Any:
        # a preemptible call is counted while it runs: a preempt waits for it (preempt.py)
        with _busy_lock(self), \
                self.preemption.call() if preempts else contextlib.nullcontext():
            try:
                return method(self, *args, **kwargs)
            except torch.cuda.OutOfMemoryError as err:  # as a CPU slot's refusal says it
                raise from_cuda_oom(err) from None

    _HOLDING_BUSY.add(holding)
    return holding


_HOLDING_BUSY: weakref.WeakSet[Any] = weakref.WeakSet()  # wrapped already: never twice


def _document_endpoints(cls: type) -> None:
    """Give each endpoint of `cls` its method's signature and docstring, so that `help()`
    shows them (Monarch's endpoint objects carry neither)."""
    for name, value in vars(cls).items():
        method = getattr(value, "_method", None)
        if isinstance(value, EndpointProperty) and method is not None:
            try:
                signature = inspect.signature(method)
                signature = signature.replace(parameters=list(signature.parameters.values())[1:])
            except (TypeError, ValueError):
                signature = "(...)"
            doc = inspect.getdoc(method)
            value.__doc__ = f"endpoint {name}{signature}" + (f"\n\n{doc}" if doc else "")


class TenantActor(Actor, metaclass=_KeepsInitError):
    """Base class of actors that time-share their slots.

    `stages` maps each stage, in wake order, to whether its contents survive a sleep
    (weights: True; caches: False). Allocate a stage's memory inside
    `with self.tenancy.region(stage):`, or hand existing tensors to `self.tenancy.adopt`.
    Call `self.tenancy.ensure_awake()` before computing.

    A tenant whose memory an engine manages hands over the engine's tenancy instead, in
    `__init__`: `self.tenancy = engine.tenancy` (its stages are then the engine's). The
    endpoints `sleep`, `wake` and `describe` always go to `self.tenancy`.

    An exception raised by `__init__` is raised by `started()`, which `rm.spawn` calls
    before registering the tenant: the spawn fails with it and the proc stays usable.
    """

    stages: ClassVar[dict[str, bool]] = {"state": True}

    @property
    def tenant_name(self) -> str:
        """The name this tenant has at the arbiter (its actor mesh's name)."""
        return current_actor_name().split("<", 1)[0]

    @property
    def tenancy(self) -> Tenancy | TaggedTenant:
        """What sleeps, wakes and describes this tenant: by default a `TaggedTenant` with one
        tag per stage, `<tenant name>/<stage>`; or what was set (an engine's tenancy)."""
        if "_tenancy" not in self.__dict__:
            prefix = self.tenant_name
            self._tenancy = TaggedTenant({s: f"{prefix}/{s}" for s in self.stages},
                                         backup=dict(self.stages), name=prefix)
        return self._tenancy

    @tenancy.setter
    def tenancy(self, tenancy: Tenancy) -> None:
        self._tenancy = tenancy

    @property
    def preemption(self) -> Preemption:
        """This tenant's preempt flag, which its `@preemptible` endpoints poll
        (`self.preemption.asked()`), and the count of those running (see `preempt`)."""
        if "_preemption" not in self.__dict__:
            with _BUSY_MADE:
                self.__dict__.setdefault("_preemption", Preemption())
        return self.__dict__["_preemption"]

    def preempt(self) -> bool:
        """The preempt hook (a plain method, not an endpoint: a `Preempter` calls it from its
        own thread while one of this tenant's calls runs). Ask the running `@preemptible`
        calls to return what they have, and say whether they will; False (the default):
        they cannot stop early, and a preempting switch drains them as any call.

        A tenant whose preemptible endpoints poll `self.preemption.asked()` overrides it:
        `self.preemption.request(); return True`."""
        return False

    @endpoint
    def started(self) -> None:
        """Raise what `__init__` raised, if it did (the exception itself, or its type and
        message when it would not survive the trip to the caller)."""
        err = self.__dict__.get("_init_error")
        if err is None:
            _HERE[self.tenant_name] = self
            return
        try:
            pickle.loads(pickle.dumps(err))
        except Exception:
            raise RuntimeError(f"{type(err).__name__}: {err}") from None
        raise err

    @endpoint
    def known_as(self, name: str, capacity: int | None = None) -> None:
        """Take `name`, the name this tenant has at its arbiter (given at registration),
        as the one its process's plans address it by: Monarch's own name for the actor may
        be spelled otherwise (a service "Gen.v2" runs as actor "genv2"). `capacity`: its
        slot's, under a policy that measures; on CPU the process's tagged memory is held
        to it (`memory.set_capacity`), as a GPU's own memory bounds it there."""
        _HERE[name] = self
        if capacity is not None and not torch.cuda.is_available():
            memory.set_capacity(capacity)

    @endpoint
    def sleep(self, stages: list[str] | None = None,
              places: dict[str, str] | None = None) -> int:
        return self.tenancy.sleep(stages, places)

    @endpoint
    def wake(self, stages: list[str]) -> None:
        self.tenancy.wake(stages)

    @endpoint
    def describe(self) -> TenantInfo:
        return self.tenancy.describe()

    @endpoint
    def receive(self, source: str) -> int:
        """Take the weights of tenant `source`, which lives in this process; returns the
        bytes copied. Tenants that take weights (generators) override this."""
        raise TypeError(f"{type(self).__name__} takes no weights: only a tenant that "
                        f"overrides receive() can be the target of a handoff from {source}")

    @endpoint
    def run_plan(self, plan: Plan) -> PlanResult:
        """Carry out the arbiter's plan for this proc (see the module), step by step,
        against the tenants of this process; answer once, with where it stopped if it
        did."""
        return run_here(plan, _tenant_here)


_HERE: weakref.WeakValueDictionary[str, TenantActor] = weakref.WeakValueDictionary()


class Preempter(Actor):
    """Asks the tenants of its process to preempt their calls (see `preempt.py`). Spawned
    beside each tenant that declares a `@preemptible` endpoint, on the same procs: it has a
    thread of its own, so it reaches a tenant while the tenant's busy lock is held."""

    @endpoint
    def preempt(self, name: str, timeout_s: float) -> str:
        """Set tenant `name`'s preempt flag and wait, up to `timeout_s`, for its running
        preemptible calls to return: `HONOURED`, `LATE`, or `UNSUPPORTED` (its hook says
        its calls cannot stop early; the flag is left unset)."""
        tenant = _HERE.get(name)
        if tenant is None or not tenant.preempt():
            return UNSUPPORTED
        return HONOURED if tenant.preemption.wait_idle(timeout_s) else LATE

    @endpoint
    def end_preempt(self, name: str) -> None:
        """Clear tenant `name`'s preempt flag: its calls from now on run to their end."""
        tenant = _HERE.get(name)
        if tenant is not None:
            tenant.preemption.clear()


class _OwnCalls:
    """A tenant actor of this process, called as its endpoints would be (each call holds
    its busy lock, so it waits for the call the tenant is running)."""

    def __init__(self, actor: TenantActor) -> None:
        self.actor = actor

    def __getattr__(self, method: str) -> Any:
        return functools.partial(endpoint_function(getattr(type(self.actor), method)),
                                 self.actor)


def _tenant_here(name: str) -> _OwnCalls:
    actor = _HERE.get(name)
    if actor is None:
        raise ArbiterError(f"tenant {name!r} is not in this process (pid {os.getpid()}; "
                           f"tenants here: {sorted(_HERE)}): a plan runs where its tenants "
                           "live, so its arbiter's view of this proc is wrong")
    return _OwnCalls(actor)


@asynccontextmanager
async def remote_errors() -> AsyncIterator[None]:
    """Raise the exception a remote actor raised, not Monarch's wrapper around it (whose
    message carries the remote traceback), so that it can be caught by its own type:

        from colocate import remote_errors
        from colocate.memory import TagPausedError

        try:
            async with remote_errors():
                await tenant.checksum.call_one()
        except TagPausedError:
            ...  # asleep: wake it with phase(...) first
    """
    try:
        yield
    except ActorError as err:
        raise err.exception from None
