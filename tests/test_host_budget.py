"""The host's memory budget for backups: where each stage a switch sleeps goes (host
memory while it fits, then no copy for what its owner refills, then disk, then a refusal
naming the bytes), never two backups of one stage, the memory layer's three places, and
an RL loop whose host capacity is below what every backup in host memory needs: it
completes, its backups' measured peak stays within the capacity, and it learns exactly
what the unconstrained run learns."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from colocate import memory
from colocate.arbiter.errors import ArbiterError, HostMemoryError
from colocate.arbiter.host_budget import Backup, HostLedger, choose, host_capacity
from colocate.arbiter.plan import SLEEP, Step
from colocate.arbiter.slot import Slot
from colocate.arbiter.tenant import TenantInfo

MiB = 1 << 20


def backups(*specs: tuple[str, str, int, bool]) -> list[Backup]:
    return [Backup(0, tenant, stage, nbytes, refill) for tenant, stage, nbytes, refill in specs]


def test_backups_that_fit_all_stay_in_host_memory():
    found = backups(("trainer", "weights", 10, False), ("trainer", "optimizer", 20, False))
    assert set(choose(found, held=5, capacity=35, disk_free=0).values()) == {"host"}
    assert set(choose(found, held=10**9, capacity=None, disk_free=0).values()) == {"host"}


def test_what_does_not_fit_drops_refillable_stages_first_then_goes_to_disk():
    found = backups(("trainer", "weights", 10, False), ("trainer", "optimizer", 20, False),
                    ("generator", "weights", 8, True))
    # 38 to keep, 35 of room: the generator's weights (its next sync rewrites them) go
    assert choose(found, 0, 35, disk_free=0) == {
        (0, "trainer", "weights"): "host", (0, "trainer", "optimizer"): "host",
        (0, "generator", "weights"): "drop"}
    # 25 of room: 30 still to keep; the fewest bytes that make it fit go to disk (10)
    assert choose(found, 0, 25, disk_free=100) == {
        (0, "trainer", "weights"): "disk", (0, "trainer", "optimizer"): "host",
        (0, "generator", "weights"): "drop"}
    # the host holds 30 already: all that must be copied goes to disk
    assert choose(found, 30, 30, disk_free=None) == {
        (0, "trainer", "weights"): "disk", (0, "trainer", "optimizer"): "disk",
        (0, "generator", "weights"): "drop"}


def test_a_switch_that_fits_nowhere_is_refused_naming_the_bytes_and_what_to_do():
    found = backups(("trainer", "weights", 10, False), ("trainer", "optimizer", 20, False))
    with pytest.raises(HostMemoryError) as err:
        choose(found, held=4, capacity=14, disk_free=5, directory="/backups")
    text = str(err.value)
    assert "must back up 30 bytes" in text and "only 10 of the host's 14 bytes" in text
    assert "/backups has 5 bytes free of the 20" in text
    assert "run.host_memory" in text and "run.backup_dir" in text
    assert (err.value.needed, err.value.free) == (30, 10)
    with pytest.raises(HostMemoryError, match="already holds more than its capacity"):
        choose(found, held=20, capacity=10, disk_free=None)


def test_a_choice_never_takes_the_host_past_its_capacity_nor_copies_what_it_need_not():
    rng = random.Random(0)
    for _ in range(2000):
        found = [Backup(0, f"t{i}", "s", rng.randrange(0, 100), rng.random() < 0.3)
                 for i in range(rng.randrange(1, 6))]
        held, capacity = rng.randrange(0, 150), rng.randrange(0, 300)
        disk = rng.choice([None, rng.randrange(0, 300)])
        try:
            places = choose(found, held, capacity, disk)
        except HostMemoryError as err:
            assert err.needed == sum(b.nbytes for b in found)
            continue
        host = sum(b.nbytes for b in found if places[b.key] == "host")
        to_disk = sum(b.nbytes for b in found if places[b.key] == "disk")
        assert held + host <= capacity
        assert disk is None or to_disk <= disk
        if held + sum(b.nbytes for b in found) <= capacity:
            assert set(places.values()) <= {"host"}  # all fit: nothing dropped or on disk
        assert not any(places[b.key] == "drop" for b in found if not b.refillable)


def slot_with(kept: tuple[str, ...], awake: tuple[str, ...]) -> Slot:
    slot = Slot(0)
    slot.infos["trainer"] = TenantInfo(1, "cpu", ("weights", "optimizer", "grads"), awake,
                                       0, 60, {"weights": 10, "optimizer": 20, "grads": 30},
                                       kept)
    slot.awake["trainer"] = awake
    return slot


def test_the_ledger_places_a_plan_counts_it_and_never_counts_a_stage_twice():
    ledger = HostLedger(capacity=25, backup_dir=None)
    slot = slot_with(("weights", "optimizer"), ("weights", "optimizer", "grads"))
    plan = ledger.place(slot, [Step(SLEEP, "trainer")])
    assert plan[0].places == (("weights", "disk"),)  # the optimizer stays in host memory
    ledger.settle(slot, plan)
    assert (ledger.held(), ledger.held("disk"), ledger.peak_counted) == (20, 10, 20)
    with pytest.raises(ArbiterError, match="never backed up twice"):
        ledger.settle(slot, plan)  # the same stages asleep again: a second backup
    slot.awake["trainer"] = ("weights", "optimizer")  # the rollback's view: all awake
    ledger.resync(slot)
    assert ledger.entries == {}
    # a handoff's plan sleeps its source twice (the optimizer, then the rest): each stage
    # is placed and counted once, as the plan's steps leave it
    twice = ledger.place(slot, [Step(SLEEP, "trainer", ("optimizer",)), Step(SLEEP, "trainer")])
    ledger.settle(slot, twice)
    assert ledger.entries == {(0, "trainer", "optimizer"): ("host", 20),
                              (0, "trainer", "weights"): ("disk", 10)}


def test_the_plans_of_two_slots_in_flight_at_once_share_the_host_budget():
    ledger = HostLedger(capacity=25, backup_dir=None)
    one, two = (slot_with(("weights", "optimizer"), ("weights", "optimizer")) for _ in "12")
    two.index = 1
    first = ledger.place(one, [Step(SLEEP, "trainer")])
    assert first[0].places == (("weights", "disk"),)  # 20 of the 25 given to slot 0's plan
    second = ledger.place(two, [Step(SLEEP, "trainer")])  # before slot 0's plan answered
    assert dict(second[0].places) == {"weights": "disk", "optimizer": "disk"}
    ledger.settle(one, first)
    ledger.settle(two, second)
    assert (ledger.held(), ledger.held("disk"), ledger.pending) == (20, 40, {})


def refill_scenario() -> dict:
    """A generator whose kept weights its next sync rewrites sleeps where the host has no
    room for them: they are dropped, not copied, and it says so."""
    from colocate.arbiter import ArbiterConfig, SlotArbiter, TaggedTenant
    from colocate.arbiter.local import LocalTenantHandle

    async def run() -> dict:
        arbiter = SlotArbiter([0], ArbiterConfig(host_capacity_bytes=0,
                                                 backup_dir="/nonexistent/colocate-backup"))
        generator = TaggedTenant({"weights": "g/weights"}, refillable=("weights",))
        held = [torch.ones(4 * MiB // 4), torch.ones(MiB // 4)]  # a tag holds weak refs
        generator.adopt(held[0], "weights")
        other = TaggedTenant({"cache": "o/cache"}, backup={"cache": False})
        other.adopt(held[1], "cache")
        await arbiter.register(0, LocalTenantHandle("generator", generator))
        await arbiter.register(0, LocalTenantHandle("other", other))
        await arbiter.wake("other")
        return {"lost": generator.lost("weights"), "traffic": memory.traffic(),
                "summary": arbiter.host_memory()}

    return asyncio.run(run())


def test_a_refillable_stage_is_dropped_not_copied_when_the_host_has_no_room(isolated):
    out = isolated(refill_scenario)
    assert out["lost"]  # its owner refills it before use (a generator: the next sync)
    # the other's cache as it registered beside the generator, then the generator's weights
    assert out["traffic"].copied_out == 0 and out["traffic"].discarded == 5 * MiB
    assert out["summary"]["peak_backup_bytes"] == out["summary"]["peak_disk_backup_bytes"] == 0


def test_the_host_capacity_is_the_cgroups_room_else_memavailable(tmp_path):
    (tmp_path / "memory.max").write_text("1000000\n")
    (tmp_path / "memory.current").write_text("400000\n")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemAvailable:      50 kB\n")
    assert host_capacity(tmp_path, meminfo) == 600000
    (tmp_path / "memory.max").write_text("max\n")
    assert host_capacity(tmp_path, meminfo) == 50 * 1024
    assert host_capacity(tmp_path / "none", meminfo) == 50 * 1024


def places_scenario(backup_dir: str) -> dict:
    """One tag paused to each place: what the process's RSS and its backups hold."""
    from colocate import telemetry

    size = 48 * MiB + 12345  # not a power of two, nor a page multiple
    t = torch.randint(0, 255, (size,), dtype=torch.uint8, generator=torch.Generator()
                      .manual_seed(0))
    want = t.clone()
    memory.adopt(t, "w", backup=True)
    memory.set_backup_dir(backup_dir)
    out: dict = {}
    for place in ("host", "disk", "drop"):
        before = telemetry.process_rss()
        memory.pause("w", place)
        out[place] = {"released": before - telemetry.process_rss(),
                      "reading": memory.backup_reading(reset_peak=True)}
        memory.resume("w")
        out[place]["intact"] = torch.equal(t, want)
        out[place]["after"] = memory.backup_reading()
    out["size"] = size
    return out


def test_each_place_releases_the_slot_memory_and_counts_its_exact_bytes(isolated, tmp_path):
    out = isolated(places_scenario, str(tmp_path))
    size = out["size"]
    for place in ("host", "disk", "drop"):
        assert out[place]["released"] >= 0.95 * size  # a CPU slot's release, as measured
        after = out[place]["after"]  # freed at the resume
        assert (after.host_bytes, after.disk_bytes) == (0, 0)
    # the tag's bytes as its chunk lays them out (64-byte aligned), not a power of two
    host, disk = out["host"]["reading"], out["disk"]["reading"]
    assert size <= host.host_bytes == host.peak_host_bytes < size + 64 and not host.disk_bytes
    assert (disk.host_bytes, disk.disk_bytes) == (0, host.host_bytes)
    assert out["host"]["intact"] and out["disk"]["intact"] and not out["drop"]["intact"]


def switch_scenario(capacity: int, backup_dir: str) -> dict:
    """A trainer (weights and optimizer kept) sleeps for a generator on one slot whose host
    has `capacity` bytes for backups; then wakes again."""
    from colocate.arbiter import ArbiterConfig, SlotArbiter, TaggedTenant
    from colocate.arbiter.local import LocalTenantHandle

    async def run() -> dict:
        arbiter = SlotArbiter([0], ArbiterConfig(host_capacity_bytes=capacity,
                                                 backup_dir=backup_dir))
        trainer = TaggedTenant({"weights": "t/weights", "optimizer": "t/optimizer"})
        weights = torch.arange(16 * MiB // 4, dtype=torch.int32)
        optimizer = torch.arange(32 * MiB // 4, dtype=torch.int32) * 3
        trainer.adopt(weights, "weights")
        trainer.adopt(optimizer, "optimizer")
        generator = TaggedTenant({"weights": "g/weights"}, backup={"weights": False})
        cache = torch.ones(8 * MiB // 4)  # a tag holds weak references
        generator.adopt(cache, "weights")
        await arbiter.register(0, LocalTenantHandle("trainer", trainer))
        await arbiter.register(0, LocalTenantHandle("generator", generator))
        out: dict = {}
        try:
            await arbiter.wake("generator")
            out["held"] = arbiter.host_memory()
            await arbiter.wake("trainer")
            out["intact"] = bool(torch.equal(weights, torch.arange(16 * MiB // 4,
                                                                     dtype=torch.int32))
                                 and torch.equal(optimizer, torch.arange(
                                     32 * MiB // 4, dtype=torch.int32) * 3))
        except HostMemoryError as err:
            out["error"] = str(err)
        out["status"] = arbiter.status()[0]
        out["summary"] = arbiter.host_memory()
        return out

    return asyncio.run(run())


def test_a_switch_past_the_host_capacity_goes_to_disk_and_stays_within_it(isolated,
                                                                             tmp_path):
    out = isolated(switch_scenario, 40 * MiB, str(tmp_path))
    assert out["intact"] and out["status"] == {"trainer": ["weights", "optimizer"],
                                               "generator": []}
    held = out["held"]  # while the trainer slept: its optimizer in memory, weights on disk
    assert (held["backup_bytes"], held["disk_backup_bytes"]) == (32 * MiB, 16 * MiB)
    summary = out["summary"]
    assert summary["peak_backup_bytes"] == 32 * MiB <= summary["host_capacity_bytes"]
    assert summary["peak_disk_backup_bytes"] == 16 * MiB
    assert summary["backup_bytes"] == summary["disk_backup_bytes"] == 0


def test_a_switch_that_fits_neither_host_nor_disk_is_refused_and_nothing_moves(isolated):
    out = isolated(switch_scenario, 8 * MiB, "/nonexistent/colocate-backup")
    assert "must back up 50331648 bytes" in out.get("error", ""), out
    assert out["status"] == {"trainer": ["weights", "optimizer"], "generator": []}
    assert out["summary"]["peak_backup_bytes"] == 0


# -- the RL loop under a host capacity below what every backup in host memory needs ---

TIMING = ("_s", "_bytes", "samples_per_s", "slept", "overlap_side_by_side")


def run_loop(out: Path, *overrides: str) -> dict:
    command = [sys.executable, "-m", "examples.rl_loop", f"run.out={out}", "run.steps=3",
               "run.eval_every=3", "run.save_every=0", "run.resume=none",
               "run.policy=exclusive", *overrides]
    done = subprocess.run(command, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "metrics.json").read_text())


def learned(metrics: dict) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.endswith(TIMING)}
            for row in metrics["steps"]]


@pytest.mark.timeout(600)
def test_an_rl_loop_with_too_little_host_memory_completes_within_it_and_learns_the_same(
        tmp_path):
    free = run_loop(tmp_path / "free")
    peak = free["summary"]["host/peak_backup_bytes"]
    assert peak > 0 and free["summary"]["host/peak_disk_backup_bytes"] == 0
    capacity = peak // 2  # every backup in host memory would need twice as much
    tight = run_loop(tmp_path / "tight", f"run.host_memory={capacity}",
                     f"run.backup_dir={tmp_path}")
    summary = tight["summary"]
    assert summary["host_capacity_bytes"] == capacity
    assert 0 < summary["host/peak_backup_bytes"] <= capacity
    assert summary["host/peak_disk_backup_bytes"] > 0
    assert learned(tight) == learned(free)
