"""Property-based tests (hypothesis): any value either gives a clear error before anything
starts, or a runtime that behaves.

(a) Pure validation, many examples: arbitrary field values for ServiceConfig,
    ResourceRequest and ArbiterConfig either construct a config whose derived values are
    consistent, or raise the project's own error naming a field that was given; requests
    against an inventory of hosts x GPUs either fit (disjoint, in bounds, first fit) or
    raise ResourceError naming what is short.
(b) The runtime, few examples (each spawns procs): services and tenants named with
    identifiers Monarch accepts, mixed with the words the code itself uses, are spawned,
    routed to, switched, killed and respawned. Monarch accepts any string as an actor name
    but rewrites it in its mesh names (lower case, only [a-z0-9_-], no leading digit or
    underscore, at most 63 characters, "nil" when nothing is left: checked on 0.7.0), so a
    runtime that reads identity back out of mesh names gets these wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import signal
import string
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from colocate import phase
from colocate.arbiter.core import ArbiterConfig, ArbiterConfigError
from colocate.arbiter.policy import POLICIES
from colocate.resources.packing import (
    Inventory,
    ResourceError,
    ResourceRequest,
    ResourceValueError,
)
from colocate.resources.procs import select
from colocate.resources.start import init
from colocate.testing import MemoryTenant
from services import ServiceConfig, ServiceConfigError, spawn_service
from services.config import ROUTERS, WHEN_ASLEEP
from services.replica import ReplicaState

pytestmark = pytest.mark.timeout(900)  # (b): several examples, seconds of procs each

# -- (a) pure validation -------------------------------------------------------------------

PURE = settings(max_examples=300, deadline=None, database=None)

# anything a caller might pass by mistake: wrong types, 0 and negatives, huge ints,
# nan and inf, strings, containers, NumPy scalars
ANY = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 10), st.integers(), st.just(2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -1.0, 0.5, 1.0]),
    st.text(max_size=6), st.sampled_from(["1", "2.0", "wait", "exclusive"]),
    st.lists(st.integers(), max_size=2), st.just(np.int64(2)), st.just(np.float64(1.5)))


def counts(optional: bool = False) -> st.SearchStrategy[Any]:
    plausible = st.integers(-1, 4)
    return st.one_of(plausible, st.none(), ANY) if optional else st.one_of(plausible, ANY)


SERVICE_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "num_replicas": counts(), "min_replicas": counts(True), "max_replicas": counts(True),
    "hosts_per_replica": counts(), "procs_per_host": counts(True),
    "procs_per_replica": counts(True), "with_gpus": st.one_of(st.booleans(), ANY),
    "resource_group": st.one_of(st.none(), st.sampled_from(["rl", ""]), ANY),
    "router": st.one_of(st.sampled_from(ROUTERS), ANY),
    "when_asleep": st.one_of(st.sampled_from(WHEN_ASLEEP), ANY),
    "wait_timeout_s": st.one_of(st.floats(-1, 100), ANY), "max_retries": counts(),
    "respawn": st.one_of(st.booleans(), ANY),
    "scale_up_queue_depth": st.one_of(st.floats(-1, 10), ANY),
    "scale_down_utilization": st.one_of(st.floats(-0.5, 1.5), ANY),
    "scale_cooldown_s": st.one_of(st.floats(-1, 100), ANY),
}
ARBITER_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "policy": st.one_of(st.sampled_from(sorted(POLICIES)), ANY),
    "release_fraction": st.one_of(st.floats(-0.5, 1.5), ANY),
    "release_timeout_s": st.one_of(st.floats(-1, 100), ANY),
    "request_timeout_s": st.one_of(st.floats(-1, 100), ANY),
    "call_timeout_s": st.one_of(st.floats(-1, 100), ANY),
    "min_verified_bytes": st.one_of(st.integers(-1, 1 << 30), ANY),
    "slot_capacity_bytes": st.one_of(st.none(), st.integers(-1, 1 << 40), ANY),
    "headroom_bytes": st.one_of(st.integers(-1, 1 << 30), ANY),
}
REQUEST_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "resource_group": st.one_of(st.sampled_from(["rl", "gen", ""]), ANY),
    "hosts": counts(), "procs_per_host": counts(), "with_gpus": st.one_of(st.booleans(), ANY),
}


def overrides(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """Some of `fields`, each with a drawn value; the others keep their defaults."""
    return st.fixed_dictionaries({}, optional=fields)


def one_field(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.sampled_from(sorted(fields)).flatmap(
        lambda name: fields[name].map(lambda value: {name: value}))


def is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return (isinstance(value, int | float | np.integer | np.floating)
            and not isinstance(value, bool) and math.isfinite(value))


def names_a_given_field(message: str, given: dict[str, Any]) -> bool:
    return any(name in message for name in given)


def assert_service_config_consistent(cfg: ServiceConfig) -> None:
    for name in ("num_replicas", "hosts_per_replica", "max_retries", "procs", "min", "max"):
        assert is_int(getattr(cfg, name)), (name, cfg)
    assert cfg.procs >= 1 and cfg.hosts_per_replica >= 1 and cfg.max_retries >= 0
    assert 1 <= cfg.min <= cfg.num_replicas <= cfg.max
    assert not (cfg.procs_per_host is not None and cfg.procs_per_replica is not None)
    assert cfg.procs_per_replica is None or cfg.hosts_per_replica == 1
    assert isinstance(cfg.with_gpus, bool) and isinstance(cfg.respawn, bool)
    assert cfg.resource_group is None or (isinstance(cfg.resource_group, str)
                                          and cfg.resource_group)
    assert cfg.router in ROUTERS and cfg.when_asleep in WHEN_ASLEEP
    for name in ("wait_timeout_s", "scale_up_queue_depth", "scale_cooldown_s"):
        assert is_number(getattr(cfg, name)) and getattr(cfg, name) > 0, (name, cfg)
    assert is_number(cfg.scale_down_utilization) and 0 <= cfg.scale_down_utilization < 1


@PURE
@given(overrides(SERVICE_FIELDS))
def test_service_config_is_consistent_or_names_a_given_field(given_: dict[str, Any]):
    try:
        cfg = ServiceConfig(**given_)
    except ServiceConfigError as err:
        assert str(err).startswith("ServiceConfig: ")
        assert names_a_given_field(str(err), given_), (str(err), given_)
        return
    assert_service_config_consistent(cfg)


@PURE
@given(one_field(SERVICE_FIELDS))
def test_one_bad_service_field_is_the_one_named(given_: dict[str, Any]):
    try:
        ServiceConfig(**given_)
    except ServiceConfigError as err:
        (name,) = given_
        assert f"{name}=" in str(err), (str(err), given_)


@PURE
@given(overrides(SERVICE_FIELDS), st.integers(1, 4), st.integers(0, 9))
def test_check_fits_refuses_exactly_the_shapes_no_host_holds(given_: dict[str, Any],
                                                            hosts: int, gpus: int):
    try:
        cfg = ServiceConfig(**given_)
    except ServiceConfigError:
        return
    fits = cfg.hosts_per_replica <= hosts and (not cfg.with_gpus or cfg.procs <= gpus)
    try:
        cfg.check_fits(hosts, gpus)
    except ServiceConfigError as err:
        assert not fits, (str(err), cfg)
        if cfg.hosts_per_replica > hosts:
            assert f"hosts_per_replica={cfg.hosts_per_replica}" in str(err)
            assert f"{hosts} host(s)" in str(err)
        else:
            assert f"procs_per_host={cfg.procs}" in str(err) and f"{gpus} GPUs" in str(err)
        return
    assert fits, cfg


@PURE
@given(overrides(ARBITER_FIELDS))
def test_arbiter_config_is_consistent_or_names_a_given_field(given_: dict[str, Any]):
    try:
        cfg = ArbiterConfig(**given_)
    except ArbiterConfigError as err:
        assert isinstance(err, ValueError)  # a bad argument, as before
        assert str(err).startswith("ArbiterConfig.")
        assert names_a_given_field(str(err), given_), (str(err), given_)
        return
    assert cfg.policy in POLICIES
    cfg.make_policy()
    assert is_number(cfg.release_fraction) and 0 < cfg.release_fraction <= 1
    for name in ("release_timeout_s", "request_timeout_s", "call_timeout_s"):
        assert is_number(getattr(cfg, name)) and getattr(cfg, name) > 0
    assert is_int(cfg.min_verified_bytes) and cfg.min_verified_bytes >= 0
    assert is_int(cfg.headroom_bytes) and cfg.headroom_bytes >= 0
    assert cfg.slot_capacity_bytes is None or (is_int(cfg.slot_capacity_bytes)
                                               and cfg.slot_capacity_bytes > 0)


@PURE
@given(one_field(ARBITER_FIELDS))
def test_one_bad_arbiter_field_is_the_one_named(given_: dict[str, Any]):
    try:
        ArbiterConfig(**given_)
    except ArbiterConfigError as err:
        (name,) = given_
        assert str(err).startswith(f"ArbiterConfig.{name}="), (str(err), given_)


@PURE
@given(overrides(REQUEST_FIELDS))
def test_resource_request_is_consistent_or_names_a_given_field(given_: dict[str, Any]):
    kwargs = {"resource_group": "rl", **given_}
    try:
        request = ResourceRequest(**kwargs)
    except ResourceValueError as err:
        assert isinstance(err, ResourceError) and isinstance(err, ValueError)
        assert names_a_given_field(str(err), given_), (str(err), given_)
        return
    assert isinstance(request.resource_group, str) and request.resource_group
    assert is_int(request.hosts) and request.hosts >= 1
    assert is_int(request.procs_per_host) and request.procs_per_host >= 1
    assert isinstance(request.with_gpus, bool)


@PURE
@given(st.one_of(st.integers(-2, 3), ANY), st.one_of(st.integers(-2, 9), ANY))
def test_an_inventory_is_built_or_names_its_bad_size(num_hosts: Any, gpus_per_host: Any):
    try:
        inventory = Inventory(num_hosts, gpus_per_host)
    except ResourceValueError as err:
        bad = "num_hosts=" if not (is_int(num_hosts) and num_hosts >= 1) else "gpus_per_host="
        assert bad in str(err), str(err)
        return
    assert is_int(num_hosts) and num_hosts >= 1 and is_int(gpus_per_host) and gpus_per_host >= 0
    if num_hosts <= 64 and gpus_per_host <= 64:  # a huge inventory is fine; listing it is not
        assert inventory.free() == {h: list(range(gpus_per_host)) for h in range(num_hosts)}


GROUPS = ["a", "b", "c", "d", "e"]
place_ops = st.tuples(st.just("place"), st.sampled_from(GROUPS), st.integers(1, 5),
                      st.integers(1, 9), st.booleans())
release_ops = st.tuples(st.just("release"), st.sampled_from(GROUPS))


@settings(max_examples=300, deadline=None, database=None)
@given(st.integers(1, 4), st.integers(0, 8), st.lists(st.one_of(place_ops, release_ops),
                                                      max_size=12))
def test_requests_fit_disjoint_first_fit_or_name_what_is_short(num_hosts: int, gpus: int,
                                                              ops: list[tuple]):
    """A model of the inventory (owned GPUs per host) says whether each request fits and
    where first fit puts it; the inventory must agree, or name what is short."""
    inventory = Inventory(num_hosts, gpus)
    owned: dict[str, set[tuple[int, int]]] = {}
    for op in ops:
        if op[0] == "release":
            _, group = op
            if group in owned:
                inventory.release(group)
                del owned[group]
            else:
                with pytest.raises(ResourceError, match=f"{group!r} is not placed"):
                    inventory.release(group)
            continue
        _, group, hosts, procs, with_gpus = op
        request = ResourceRequest(group, hosts, procs, with_gpus)
        taken = set().union(*owned.values())
        free = {h: [g for g in range(gpus) if (h, g) not in taken] for h in range(num_hosts)}
        starts = [first for first in range(num_hosts - hosts + 1)
                  if all(len(free[h]) >= procs for h in range(first, first + hosts))]
        try:
            placement = inventory.place(request)
        except ResourceError as err:
            message = str(err)
            if group in owned:
                assert "already placed" in message
            elif hosts > num_hosts:
                assert f"{hosts} hosts; there are {num_hosts}" in message
            elif not with_gpus:
                pytest.fail(f"a request without GPUs whose hosts exist was refused: {message}")
            elif procs > gpus:
                assert f"{procs} GPUs per host; a host has {gpus}" in message
            else:
                assert not starts, (message, free)
                assert all(f"host {h}: {len(g)} free" in message for h, g in free.items())
            continue
        assert group not in owned and hosts <= num_hosts
        assert placement.hosts == tuple(range(placement.hosts[0], placement.hosts[0] + hosts))
        assert placement.procs_per_host == procs and placement.with_gpus == with_gpus
        if not with_gpus:
            assert placement.gpus == ((),) * hosts
            owned[group] = set()
            continue
        assert starts and placement.hosts[0] == starts[0], (placement, free)  # first fit
        cells = {(h, g) for h, host_gpus in zip(placement.hosts, placement.gpus, strict=True)
                 for g in host_gpus}
        for h, host_gpus in zip(placement.hosts, placement.gpus, strict=True):
            assert list(host_gpus) == free[h][:procs]  # the lowest free GPUs, in bounds
        assert len(cells) == hosts * procs and not cells & taken  # disjoint
        owned[group] = cells
    taken = set().union(*owned.values())
    assert inventory.free() == {h: [g for g in range(gpus) if (h, g) not in taken]
                                for h in range(num_hosts)}


# -- (b) the runtime -----------------------------------------------------------------------

# Each example spawns procs (seconds each, 30 s for a service pair with a respawn): the
# explicit examples (the names known to have broken something) and 2 drawn ones, the same
# every run, no shrinking (a failing example is reported as drawn), nothing stored between runs.
RUNTIME = settings(max_examples=2, deadline=None, derandomize=True, database=None,
                   phases=[Phase.explicit, Phase.generate],
                   suppress_health_check=[HealthCheck.function_scoped_fixture,
                                          HealthCheck.too_slow])
WORDS = ["gen", "_g1", "_g", "arbiter", "trainer", "generator", "rl", "probe", "_r0", "-",
         "0", "7", "nil"]
piece = st.one_of(st.sampled_from(WORDS),
                  st.text(string.ascii_letters + string.digits + "_-.", min_size=1, max_size=6))
names = st.lists(piece, min_size=1, max_size=3).map("".join)
WAIT_S = 20.0  # a routed call waits this long for an awake replica
FAULT_S = 30.0  # Monarch supervision reports a killed proc within a few seconds
RESPAWN_S = 90.0
_groups = itertools.count()


@pytest.fixture
def runtime():
    """One runtime (2 virtual slots) per test, for all its examples: procs cost seconds.
    The examples run on this loop, the runtime's own."""
    loop = asyncio.new_event_loop()
    rm = loop.run_until_complete(init("local", gpus_per_host=2))
    try:
        yield loop, rm
    finally:
        loop.run_until_complete(rm.shutdown())
        loop.close()


async def until(check: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds} s: {what}")
        await asyncio.sleep(0.05)


def awake_on(status: dict, host: int, slot: int) -> list[str]:
    return [name for name, stages in status[host][slot].items() if stages]


async def pids(actors: Any) -> list[int]:
    return [value["pid"] for _, value in (await actors.memory.call()).items()]


async def tidy(rm: Any, made: list[Any], tenants: dict[str, Any], groups: list[str]) -> None:
    """Whatever an example left, also after a failure, so that the next one starts clean:
    its services shut down, its tenants removed, its groups released."""
    for svc in made:
        if not svc.closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(svc.shutdown(grace_s=5), 60)
    for name, actors in tenants.items():
        if rm.faults.known(name):
            with contextlib.suppress(Exception):
                await rm.remove(name, actors)
    for group in groups:
        if rm.has_group(group):
            await rm.release(group)


async def services_scenario(rm: Any, name: str, other: str, replicas: int, procs: int) -> None:
    """Service `name` (its own resource group, named after it) beside `other`, a one-replica
    service over the whole group; both routed to, switched, killed and respawned; then
    `name` is served again from scratch (a name may be used again)."""
    made: list[Any] = []
    try:
        await serve_switch_respawn(rm, made, name, other, replicas, procs)
        await rm.release(name)
        again = await spawn_service(ServiceConfig(wait_timeout_s=WAIT_S), MemoryTenant, 1, 3,
                                    name=name)
        made.append(again)
        async with phase(again):
            assert await again.work.route(9) == 9
    finally:
        await tidy(rm, made, {}, [name])


async def serve_switch_respawn(rm: Any, made: list[Any], name: str, other: str,
                               replicas: int, procs: int) -> None:
    a = await spawn_service(ServiceConfig(num_replicas=replicas, procs_per_host=procs,
                                          wait_timeout_s=WAIT_S), MemoryTenant, 4, 1, name=name)
    made.append(a)
    b = await spawn_service(ServiceConfig(procs_per_host=replicas * procs, resource_group=name,
                                          wait_timeout_s=WAIT_S), MemoryTenant, 4, 2, name=other)
    made.append(b)
    async with phase(a):
        assert [await a.work.route(i) for i in range(3)] == [0, 1, 2]
        awake = rm.awake_tenants()
        assert set(a.tenant_names()) <= set(awake) and b.tenant_names()[0] not in awake
        assert await a.work.fanout(5) == [5] * replicas
    async with phase(b):
        assert await b.work.route(7) == 7
        status = await rm.status()
        assert all(awake_on(status, host, slot) == b.tenant_names()
                   for host, slot in b.replicas[0].allocation.slots), status
        assert not set(a.tenant_names()) & set(rm.awake_tenants())

    victim, survivor = a.replicas[0], b.replicas[0]
    old_tenant, old_slots = victim.tenant, victim.allocation.slots
    old_pid = (await pids(victim.actors))[0]
    os.kill(old_pid, signal.SIGKILL)  # a proc of the group: both services lose a replica
    # no call is made: supervision alone finds both failures and respawns both replicas
    await until(lambda: victim.generation == 1 and victim.state is ReplicaState.HEALTHY
                and survivor.generation == 1 and survivor.state is ReplicaState.HEALTHY,
                RESPAWN_S, f"both replicas respawn: {a.failures()} | {b.failures()}")
    assert victim.allocation.slots == old_slots and victim.tenant != old_tenant
    assert old_pid not in await pids(victim.actors)
    async with phase(a):
        assert [await a.work.route(i) for i in range(4)] == [0, 1, 2, 3]
        assert set(a.tenant_names()) <= set(rm.awake_tenants())
    async with phase(b):
        assert await b.work.route(8) == 8
    for svc in (a, b):
        served = [c for r in svc.replicas for _, c in (await r.actors.counts.call()).items()]
        assert all(c["asleep"] == 0 for c in served), served
    await a.shutdown()
    await b.shutdown()


@RUNTIME
@given(st.lists(names, min_size=2, max_size=2, unique=True),
       st.sampled_from([(1, 1), (2, 1), (1, 2)]))
@example(["gen", "trainer"], (2, 1))  # plain names; then "gen" is served again
@example(["my_gen", "rl"], (1, 1))  # "_g" in the name: the respawn's generation
@example(["Gen.v2", "arbiter"], (1, 2))  # a name that Monarch rewrites
def test_services_with_any_name_route_switch_and_respawn(runtime, pair: list[str],
                                                         shape: tuple[int, int]):
    loop, rm = runtime
    replicas, procs = shape
    loop.run_until_complete(asyncio.wait_for(
        services_scenario(rm, pair[0], pair[1], replicas, procs), 300))


async def tenants_scenario(rm: Any, group: str, x: str, y: str, z: str) -> None:
    """Tenants x and y on slot 0, z on slots 0 and 1 of one group; switched among
    themselves with contents kept; then slot 1's proc dies: z alone is failed, and the
    others go on once it is removed."""
    tenants: dict[str, Any] = {}
    try:
        request = ResourceRequest(group, 1, 2)
        await rm.reserve(request)
        one = ResourceRequest(group, 1, 1)
        for name, shape, seed in ((x, one, 1), (y, one, 2), (z, request, 3)):
            allocation = await rm.allocate(shape, owner=name)
            tenants[name] = await rm.spawn(name, MemoryTenant, allocation, 4, seed)
        sums = {}
        for name in (x, z, y, z, x):
            await rm.wake(name)
            status = await rm.status()
            assert awake_on(status, 0, 0) == [name], status
            assert [n for n in tenants if n in rm.awake_tenants()] == [name]
            found = [s for _, s in (await tenants[name].checksum.call()).items()]
            assert sums.setdefault(name, found) == found  # the weights survived the sleeps
        doomed = await select(tenants[z], gpus=1).memory.call_one()
        os.kill(doomed["pid"], signal.SIGKILL)
        await until(lambda: rm.faults.has_failed(z), FAULT_S,
                    f"supervision marks {z!r} failed")
        await asyncio.sleep(1.0)  # the faults of every mesh on that proc have arrived
        assert not rm.faults.has_failed(x) and not rm.faults.has_failed(y)
        assert rm.routable(x) and not rm.routable(z)
        await rm.remove(z, tenants.pop(z))
        await rm.wake(y)
        assert rm.routable(y) and not rm.routable(x)
        assert [s for _, s in (await tenants[y].checksum.call()).items()] == sums[y]
    finally:
        await tidy(rm, [], tenants, [group])


@RUNTIME
@given(st.lists(names, min_size=4, max_size=4, unique=True))
@example(["rl", "probe", "gen", "trainer"])  # a tenant named as the group's probe actors
@example(["x_g2", "gen_r0", "gen", "A-1"])  # Monarch names the mesh "a-1-<id>"
def test_tenants_with_any_name_switch_and_fail_alone(runtime, four: list[str]):
    loop, rm = runtime
    group, x, y, z = four
    group = f"{group}{next(_groups)}"  # a group is released at the end; a fresh one each time
    loop.run_until_complete(asyncio.wait_for(tenants_scenario(rm, group, x, y, z), 300))
