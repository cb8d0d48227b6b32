"""A sync on roomy slots is the copy alone: under the budget policy, where every tenant is
awake and every declared working memory fits, the trainer's weights go to the generator
with one message to their procs and no arbiter switch; where they do not fit, the
arbiters run the handoff as before. Switches of the two tenants wait for an in-place copy,
and a proc lost during one fails it with `TenantLostError`, not a hang. Real Monarch procs
and engine actors."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch

from colocate import ArbiterConfig, phase
from colocate.arbiter import TenantLostError
from colocate.engines.actors import GeneratorActor, TrainerActor
from colocate.engines.tiny import write_tiny_model
from colocate.resources.switching import InPlaceCopies
from colocate.testing import start_runtime
from services import ServiceConfig, spawn_service, sync_weights

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("procs_import_tests")]

MiB = 1 << 20
BATCH = torch.tensor([[1, 4, 5, 13, 6, 7, 14], [1, 12, 3, 8, 13, 4, 14]])


def logit_loss(module, batch):
    """Pushes token 5's logits down, so a step visibly changes the weights."""
    return module(input_ids=batch).logits[..., 5].mean(), {"rows": float(batch.shape[0])}


@pytest.fixture
def model_dir(tmp_path):
    return str(write_tiny_model(tmp_path / "model", "qwen2", alphabet="0123456789+=>",
                                init_std=0.1))


class CountedArbiters:
    """The switchboard's arbiter handles, with the endpoints the client asked of them."""

    def __init__(self, switchboard) -> None:
        self.asked: list[str] = []
        self._arbiter = switchboard.arbiter
        switchboard.arbiter = self

    def __call__(self, host: int):
        handle = self._arbiter(host)
        asked = self.asked

        class Counted:
            def __getattr__(self, endpoint: str):
                asked.append(endpoint)
                return getattr(handle, endpoint)

        return Counted()


async def spawn_pair(model_dir: str, slots: int, parallel: str):
    trainer = await spawn_service(ServiceConfig(procs_per_host=slots, resource_group="rl"),
                                  TrainerActor, model_dir, lr=0.05, name="trainer",
                                  parallel=parallel)
    generator = await spawn_service(ServiceConfig(num_replicas=slots, resource_group="rl"),
                                    GeneratorActor, model_dir, engine="torch",
                                    name="generator")
    return trainer, generator


async def test_a_sync_on_roomy_slots_is_the_copy_alone(model_dir):
    """FSDP over two slots (each bucket gathered by both ranks at once), ample memory: no
    arbiter is asked anything for the sync, and everyone stays awake. (Where the slots lack
    room, the arbiters hand off: tests/test_engine_actors.py, test_budget.py.)"""
    budget = ArbiterConfig(policy="budget", slot_capacity_bytes=1024 * MiB)
    async with start_runtime(gpus_per_host=2, arbiter=budget) as rm:
        trainer, generator = await spawn_pair(model_dir, 2, "fsdp")
        async with phase(generator):
            await generator.checksum.fanout()
        async with phase(trainer):
            await trainer.train_step.route(logit_loss, BATCH)
            trained = await trainer.checksum.route()
        counted = CountedArbiters(rm.switchboard)
        report = await sync_weights(trainer, generator)
        assert set(report.handoff) == {"generator_r0", "generator_r1"}
        assert all(nbytes > 0 for nbytes in report.handoff.values())
        status = await rm.status()
        for slot in (0, 1):
            assert status[0][slot] == {"trainer_r0": ["weights", "optimizer", "grads"],
                                       f"generator_r{slot}": ["weights"]}, status
        async with phase(generator):
            assert await generator.checksum.fanout() == [trained, trained]
        assert counted.asked == []  # neither for the sync nor for the wake


async def test_a_proc_lost_during_an_in_place_copy_fails_it_naming_the_tenants(model_dir):
    budget = ArbiterConfig(policy="budget", slot_capacity_bytes=1024 * MiB)
    async with start_runtime(gpus_per_host=1, arbiter=budget) as rm:
        trainer, generator = await spawn_pair(model_dir, 1, "ddp")
        async with phase(generator):
            await generator.checksum.fanout()
        os.kill(generator.replicas[0].allocation.pids[0], signal.SIGKILL)
        with pytest.raises(TenantLostError, match="generator_r0 lost"):
            await asyncio.wait_for(rm.handoff("trainer_r0", "generator_r0"), 60)


async def test_a_switch_of_a_tenant_waits_for_its_in_place_copy():
    copies = InPlaceCopies()
    order: list[str] = []

    async def copy() -> None:
        async with copies.running_on({"trainer", "gen"}):
            await asyncio.sleep(0.05)
            order.append("copied")

    async def switch(touched: set[str]) -> None:
        await copies.ended(touched)
        order.append(f"switched {sorted(touched)}")

    running = asyncio.create_task(copy())
    await asyncio.sleep(0)
    assert copies.busy({"gen"}) and not copies.busy({"reference"})
    await asyncio.gather(switch({"reference"}), switch({"trainer"}), running)
    assert order == ["switched ['reference']", "copied", "switched ['trainer']"]
    assert not copies.busy({"trainer", "gen"})
