"""A fault at every step of a switch, a handoff and a weight sync (its buckets): an
exception in the tenant's endpoint, SIGKILL of its proc, a hang past the arbiter's timeout
(a hung proc is killed, and lost as a killed one; a release that comes back late is not a
hang of the proc: its plan answers, failed).

A rig is two tenants, a trainer and a generator, on the 2 procs of their own resource
group; the fault hits the rig's first slot only (`tests/faulty.py`), the second goes
through the same switch. After each fault the test measures that the arbiter's reported
state is what the procs hold (each tenant's own account, and the proc's RSS), that no slot
has two tenants awake, that the kept weights of every tenant that survived are
bit-identical (a handoff's target: its old weights or the whole copy, never a mix unless
the error says so), that the error names the tenant, the slot and the step, and that the
next switch is served, or refused with the slot said lost and why. Rows that leave the
rig usable share one rig; a killed proc's rig is removed and its group released (no proc
left, checked by pid), and new rigs are spawned 4 at a time. The table of steps x faults
is printed (`pytest -s` shows it). The rows that end a rig's procs run at once, one per
rig: their switches meet nowhere (each rig's slots are its own), only in the arbiter.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import psutil
import pytest
from faulty import FaultyTenant

from colocate.arbiter import (
    ArbiterConfig,
    SlotArbiter,
    SwitchError,
    TenantInfo,
    TenantLostError,
)
from colocate.resources.manager import ResourceManager
from colocate.resources.packing import ResourceRequest
from colocate.resources.procs import select
from colocate.testing import start_runtime

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("procs_import_tests")]

MiB = 1 << 20
CONFIG = ArbiterConfig(call_timeout_s=4.0, release_timeout_s=1.0)
HANG_S = 5.0  # past both timeouts; the rollback's call, queued behind it, has 3 s left
WEIGHTS_MIB, CACHE_MIB = 32, 32
RSS_TOLERANCE = 12 * MiB  # a proc's RSS vs its tenants' resident bytes, from the row's start
RIGS_AT_ONCE = 4  # on 8 virtual slots
SOURCE, TARGET = "trainer", "generator"  # the roles; a rig's tenants are named after them

# (operation, role, step): every step where a tenant is called or measured, in order
STEPS = [
    ("switch", SOURCE, "sleep:cache"),
    ("switch", SOURCE, "sleep:weights"),
    ("switch", SOURCE, "release:weights"),
    ("switch", TARGET, "wake:weights"),
    ("switch", TARGET, "wake:cache"),
    ("handoff", SOURCE, "sleep:cache"),
    ("handoff", SOURCE, "release:cache"),
    ("handoff", TARGET, "wake:weights"),
    ("handoff", TARGET, "receive:0"),
    ("handoff", TARGET, "receive:1"),
    ("handoff", SOURCE, "sleep:weights"),
    ("handoff", SOURCE, "release:weights"),
    ("handoff", TARGET, "wake:cache"),
]
FAULTS = ["raise", "hang", "kill"]


def lethal(fault: str, step: str) -> bool:
    """Whether the fault ends the proc: a kill, or a hang of a call past the arbiter's
    call timeout (a late release is checked within the plan, which answers)."""
    return fault == "kill" or fault == "hang" and not step.startswith("release")
# how the arbiter's own words name each step (the injected exception's text is removed
# before looking, so it cannot name the step for it)
STEP_WORDS = {"sleep": ("failed to sleep", ".sleep"), "wake": ("failed to wake", ".wake("),
              "release": ("came back", "release check"), "receive": (".receive(",)}
INJECTED = re.compile(r"injected fault at \S+ in \S+ on slot \d+")


@dataclass
class Rig:
    """Two tenants on the 2 procs of their own resource group."""

    rm: ResourceManager
    group: str
    names: dict[str, str]  # role -> tenant name
    tenants: dict[str, Any]  # role -> actor mesh
    slots: tuple[int, ...]  # in mesh order: the fault's slot, then the other
    pids: dict[int, int]  # slot -> pid


@dataclass
class Outcome:
    op: str
    step: str
    fault: str
    error: str = "-"
    names: str = "-"
    state: str = "-"
    awake: str = "-"
    rss: str = "-"
    kept: str = "-"
    next: str = "-"
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)


async def new_rig(rm: ResourceManager, index: int) -> Rig:
    group = f"rig{index}"
    request = ResourceRequest(group, 1, 2)
    names = {role: f"{role}{index}" for role in (SOURCE, TARGET)}
    tenants = {}
    for seed, (role, name) in enumerate(names.items(), 1):
        allocation = await rm.allocate(request, name)
        tenants[role] = await rm.spawn(name, FaultyTenant, allocation, WEIGHTS_MIB,
                                       CACHE_MIB, seed)
    slots = tuple(slot for _, slot in allocation.slots)
    rig = Rig(rm, group, names, tenants, slots, {})
    rig.pids = {slot: (await on_slot(rig, SOURCE, "held", slot))["pid"] for slot in slots}
    return rig


async def new_rigs(rm: ResourceManager, indices: Iterable[int]) -> list[Rig]:
    return list(await asyncio.gather(*(new_rig(rm, i) for i in indices)))


async def drop_rig(rig: Rig) -> None:
    """Forget the tenants, release the group; no proc of it may be left."""
    await asyncio.gather(*(rig.rm.remove(rig.names[role], actors, grace_s=0.5)
                           for role, actors in rig.tenants.items()))
    await rig.rm.release(rig.group, grace_s=0.5)
    await gone(rig.pids.values())


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def gone(pids: Iterable[int], within_s: float = 5.0) -> None:
    """Wait until no process of `pids` runs (a SIGKILL lands a moment after it is sent)."""
    deadline = time.monotonic() + within_s
    while (left := [pid for pid in pids if alive(pid)]) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not left, f"procs left behind: {left}"


async def on_slot(rig: Rig, role: str, endpoint: str, slot: int, *args: Any) -> Any:
    """One proc's answer (the tenant's actor on `slot`)."""
    actors = select(rig.tenants[role], gpus=rig.slots.index(slot))
    return await getattr(actors, endpoint).call_one(*args)


async def kept(rig: Rig, role: str) -> dict[int, str]:
    """slot -> checksum of the tenant's weights, on the live procs (it must be awake)."""
    return {slot: await on_slot(rig, role, "checksum", slot)
            for slot, pid in rig.pids.items() if alive(pid)}


async def apart(rig: Rig) -> dict[int, int]:
    """slot -> the proc's RSS less what its tenants say they hold."""
    out = {}
    for slot, pid in rig.pids.items():
        if alive(pid):
            rss = (await on_slot(rig, SOURCE, "held", slot))["rss"]
            infos = [await on_slot(rig, role, "describe", slot) for role in rig.tenants]
            out[slot] = rss - sum(info.resident_bytes for info in infos)
    return out


async def measure(rig: Rig, baseline: dict[int, int], outcome: Outcome) -> None:
    """The arbiter's reported state vs what each proc holds; awake tenants per slot."""
    status = (await rig.rm.status())[0]
    mismatches, awake, deviations = [], [], []
    for slot, pid in rig.pids.items():
        reported = {role: status[slot].get(name) for role, name in rig.names.items()}
        if not alive(pid):  # a dead proc holds nothing: the arbiter must not count on it
            if any(stages is not None for stages in reported.values()):
                mismatches.append(f"slot {slot}: proc dead, arbiter {reported}")
            awake.append(0)
            continue
        infos = {role: await on_slot(rig, role, "describe", slot) for role in rig.tenants}
        truth = {role: list(info.awake_stages) for role, info in infos.items()}
        if truth != reported:
            mismatches.append(f"slot {slot}: arbiter {reported}, procs {truth}")
        awake.append(max(sum(bool(s) for s in truth.values()),
                         sum(bool(s) for s in reported.values())))
        rss = (await on_slot(rig, SOURCE, "held", slot))["rss"]
        held = sum(info.resident_bytes for info in infos.values())
        deviation = rss - held - baseline[slot]
        deviations.append(deviation)
        if abs(deviation) > RSS_TOLERANCE:
            mismatches.append(f"slot {slot}: RSS {rss / MiB:.0f} MiB, tenants hold "
                              f"{held / MiB:.0f} MiB (+{baseline[slot] / MiB:.0f} MiB base)")
    outcome.state = "match" if not mismatches else "MISMATCH"
    outcome.awake = "/".join(map(str, awake))
    outcome.rss = "/".join(f"{d / MiB:+.0f}" for d in deviations) or "-"
    outcome.problems += mismatches
    if max(awake) > 1:
        outcome.problems.append(f"two tenants awake: {status}")


def check_error(err: BaseException | None, rig: Rig, role: str, step: str, fault: str,
                outcome: Outcome) -> None:
    if err is None:
        outcome.error = "NONE"
        outcome.problems.append("the switch did not fail")
        return
    outcome.error = type(err).__name__
    text = INJECTED.sub("<injected>", str(err))
    named = {"tenant": rig.names[role] in text, "slot": f"slot {rig.slots[0]}" in text,
             "step": any(word in text for word in STEP_WORDS[step.split(":")[0]])}
    if fault == "kill":
        named["lost"] = isinstance(err, TenantLostError) and "died" in text
    elif lethal(fault, step):
        named["lost"] = isinstance(err, TenantLostError) and "did not answer" in text \
            and "killed" in text
    outcome.names = "yes" if all(named.values()) else \
        "NO " + ",".join(k for k, ok in named.items() if not ok)
    if not isinstance(err, SwitchError) or not all(named.values()):
        outcome.problems.append(f"error does not name {named}: {type(err).__name__}: {err}")


def classify(now: str, old: str, new: str) -> str:
    return "old" if now == old else "new" if now == new else "torn"


async def run_row(rig: Rig, op: str, role: str, step: str, fault: str, seed: int) -> Outcome:
    rm, source, target = rig.rm, rig.names[SOURCE], rig.names[TARGET]
    fault_slot, other_slot = rig.slots
    outcome = Outcome(op, f"{role}.{step}", fault)
    # distinct weights, read while awake; then the source awake, as before a switch
    await rm.wake(target)
    await rig.tenants[TARGET].scramble.call(seed)
    target_before = await kept(rig, TARGET)
    await rm.wake(source)
    source_before = await kept(rig, SOURCE)
    baseline = await apart(rig)

    await rig.tenants[role].arm.call(step, fault, fault_slot, HANG_S)
    start = time.monotonic()
    err: BaseException | None = None
    try:
        if op == "switch":
            await rm.wake(target)
        else:
            await rm.handoff(source, target)
    except Exception as caught:
        err = caught
    outcome.seconds = time.monotonic() - start
    if lethal(fault, step):  # the kernel takes a moment to end a killed process
        await gone([rig.pids[fault_slot]])
    check_error(err, rig, role, step, fault, outcome)
    await measure(rig, baseline, outcome)

    # the next switches: served, or refused with the slot said lost
    survivors: dict[str, dict[int, str]] = {}
    refusals = []
    for r in (SOURCE, TARGET):
        try:
            await rm.wake(rig.names[r])
        except TenantLostError as lost:
            refusals.append(lost)
        except Exception as other:
            outcome.problems.append(f"the next wake of {rig.names[r]} failed: {other}")
        survivors[r] = await kept(rig, r)
    if lethal(fault, step):
        said = all(f"slot {fault_slot}" in str(r) and "lost" in str(r) for r in refusals)
        outcome.next = "lost, said" if len(refusals) == 2 and said else "NOT SAID"
        if outcome.next != "lost, said":
            outcome.problems.append(f"after the kill, wakes answered {refusals}")
    else:
        outcome.next = "ok" if not refusals else "REFUSED"
        outcome.problems += [f"refused: {r}" for r in refusals]

    # kept contents: the source's never change; the target's are old or the whole copy
    marks = []
    for slot, now in survivors[SOURCE].items():
        if now != source_before[slot]:
            outcome.problems.append(f"{source}'s weights changed on slot {slot}")
            marks.append(f"{SOURCE}[{slot}] CHANGED")
    for slot, now in survivors[TARGET].items():
        got = classify(now, target_before[slot], source_before[slot])
        marks.append(f"{'fault' if slot == fault_slot else 'other'}:{got}")
        expected = {"old"} if op == "switch" else {"old", "new"}
        if op == "handoff" and slot == other_slot:
            expected = {"new"}  # no fault there: the handoff went through
        if got == "torn" and err is not None and "may hold part of" in str(err):
            expected.add("torn")  # the error said so
        if got not in expected:
            outcome.problems.append(f"{target}'s weights on slot {slot} are {got}, "
                                    f"expected {sorted(expected)}")
    outcome.kept = f"{SOURCE} same; {TARGET} " + " ".join(marks) \
        if not any("CHANGED" in m for m in marks) else " ".join(marks)
    return outcome


def table(outcomes: list[Outcome]) -> str:
    columns = ["op", "step", "fault", "error", "names", "state", "awake", "rss", "kept",
               "next", "seconds"]
    rows = [[o.op, o.step, o.fault, o.error, o.names, o.state, o.awake, o.rss, o.kept,
             o.next, f"{o.seconds:.2f}"] for o in outcomes]
    widths = [max(len(str(r[i])) for r in [columns, *rows]) for i in range(len(columns))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))
             for r in [columns, *rows]]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


async def test_a_fault_at_every_step_leaves_a_consistent_slot_and_a_clear_error():
    seeds = itertools.count(100)
    indices = itertools.count()
    outcomes: list[Outcome] = []
    renewals: list[float] = []
    rows = [(op, role, step, fault) for fault in FAULTS for op, role, step in STEPS]
    kills = [row for row in rows if lethal(row[3], row[2])]
    try:
        async with start_runtime(gpus_per_host=2 * RIGS_AT_ONCE, arbiter=CONFIG) as rm:
            rigs = await new_rigs(rm, itertools.islice(indices, RIGS_AT_ONCE))
            for row in rows:  # those that leave the rig usable: one rig serves them all
                if row not in kills:
                    outcomes.append(await run_row(rigs[0], *row, next(seeds)))
            while kills:
                batch, kills = kills[:len(rigs)], kills[len(rigs):]
                outcomes += await asyncio.gather(*(  # rigs apart: on slots of their own
                    run_row(rig, *row, next(seeds)) for rig, row in zip(rigs, batch, strict=False)))
                start = time.monotonic()
                await asyncio.gather(*(drop_rig(rig) for rig in rigs))
                if kills:
                    rigs = await new_rigs(rm, itertools.islice(indices,
                                                               min(len(kills), RIGS_AT_ONCE)))
                    renewals.append(time.monotonic() - start)
    finally:  # the table so far, also when a row broke the test
        order = {(op, f"{r}.{s}"): i for i, (op, r, s) in enumerate(STEPS)}
        outcomes.sort(key=lambda o: (order[o.op, o.step], FAULTS.index(o.fault)))
        print(f"\n{table(outcomes)}\n(state: arbiter vs procs; awake: awake tenants on the "
              "fault's slot/the other; rss: MiB a proc holds beyond its tenants' account, vs "
              f"the row's start; kept: {TARGET}'s weights per slot: old, new = {SOURCE}'s "
              "whole copy, torn)")
        if renewals:
            print("killed rigs removed, their groups released, up to "
                  f"{RIGS_AT_ONCE} new rigs spawned, in "
                  + ", ".join(f"{s:.1f}" for s in renewals) + " s")
    problems = [f"{o.op} {o.step} {o.fault}: {p}" for o in outcomes for p in o.problems]
    assert not problems, "\n".join(problems)


@dataclass
class ProcTenantHandle:
    """A tenant living in process `pid`, reached by calls that never answer once it is
    gone (as a Monarch call to a killed proc): what the arbiter must notice by itself."""

    name: str
    pid: int
    awake: tuple[str, ...]

    async def describe(self) -> TenantInfo:
        return TenantInfo(self.pid, "cpu", ("weights",), self.awake, 0, 0)

    async def sleep(self, stages: Any = None) -> int:
        await asyncio.Event().wait()  # the answer never comes
        return 0

    async def wake(self, stages: Any) -> None:
        self.awake = tuple(stages)


async def test_a_tenant_whose_proc_dies_is_lost_at_once_not_after_the_call_timeout():
    proc = await asyncio.create_subprocess_exec("sleep", "60")
    arbiter = SlotArbiter([0], ArbiterConfig(call_timeout_s=60))
    await arbiter.register(0, ProcTenantHandle("a", proc.pid, ("weights",)))
    await arbiter.register(0, ProcTenantHandle("b", os.getpid(), ()))
    switch = asyncio.create_task(arbiter.wake("b"))  # a's sleep never answers
    await asyncio.sleep(0.2)
    start = time.monotonic()
    proc.kill()
    with pytest.raises(TenantLostError, match=rf"a failed to sleep on slot 0: a lost on slot "
                       rf"0: its proc, pid {proc.pid}, died during a.sleep\. .*rm.release"):
        await switch
    assert time.monotonic() - start < 1.0
    assert (switch.exception().slot, switch.exception().tenants) == (0, ("a",))
    assert arbiter.status() == {0: {"a": None, "b": []}}
    await arbiter.wake("b")  # a holds nothing now: b wakes without it
    assert arbiter.status() == {0: {"a": None, "b": ["weights"]}}
    with pytest.raises(TenantLostError, match="a cannot wake on slot 0: it is lost"):
        await arbiter.wake("a")
    await arbiter.unregister("a")  # forgotten, as rm.remove does
    assert arbiter.status() == {0: {"b": ["weights"]}}
    await proc.wait()


async def test_tenants_lost_on_two_slots_are_all_named():
    """One switch over two slots whose tenants' procs both die: one TenantLostError that
    names every lost tenant (the resource manager marks them all failed from it)."""
    procs = [await asyncio.create_subprocess_exec("sleep", "60") for _ in range(2)]
    arbiter = SlotArbiter([0, 1], ArbiterConfig(call_timeout_s=60))
    for slot, (name, proc) in enumerate(zip(("a0", "a1"), procs, strict=True)):
        await arbiter.register(slot, ProcTenantHandle(name, proc.pid, ("weights",)))
        await arbiter.register(slot, ProcTenantHandle("b", os.getpid(), ()))
    switch = asyncio.create_task(arbiter.wake("b"))  # a0's and a1's sleeps never answer
    await asyncio.sleep(0.2)
    for proc in procs:
        proc.kill()
    with pytest.raises(TenantLostError, match="2 of 2 slots failed: .*a0 lost.*a1 lost"):
        await switch
    assert sorted(switch.exception().tenants) == ["a0", "a1"]
    for proc in procs:
        await proc.wait()
