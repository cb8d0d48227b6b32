"""The runtime itself on the GPUs present (1 to 8), through Monarch: `init` finds the GPUs
by NVML, a resource group starts one proc per GPU (each on its GPU by UUID), and a trainer
and the built-in generator take turns on every GPU through the arbiters, each release
verified in the proc by NVML per process. The CPU twin is tests/test_engine_actors.py.

Needs Monarch beside torch: `device.sh fetch` packs it for the GPU machine."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("monarch")

from colocate import phase  # noqa: E402
from colocate.engines.actors import GeneratorActor, TrainerActor  # noqa: E402
from colocate.engines.sampling import SamplingParams  # noqa: E402
from colocate.engines.tiny import write_tiny_model  # noqa: E402
from colocate.resources.gpus import gpus_per_host  # noqa: E402
from services import ServiceConfig, spawn_service, sync_weights  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("procs_import_tests")]

PROMPTS = [[1, 4, 5, 13, 6, 7, 14], [1, 10, 15], [1, 12, 3, 8, 13, 4, 14]]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=(2,))


def logit_loss(module, batch):
    """Pushes token 5's logits down, so a step visibly changes the weights."""
    return module(input_ids=batch.to(module.device)).logits[..., 5].mean(), {}


async def test_trainer_and_generator_take_turns_through_the_arbiters_on_every_gpu(
        colocate_runtime, tmp_path):
    rm = colocate_runtime
    slots = len((await rm.status())[0])
    assert slots == min(gpus_per_host(), 8)  # init found the GPUs: real slots, not virtual
    # big enough that a release is measured (the plan verifies from 1 MiB), small to load
    model_dir = str(write_tiny_model(tmp_path / "model", "qwen2", alphabet="0123456789+=>",
                                     hidden_size=512, layers=4, heads=8, kv_heads=2,
                                     intermediate_size=1024, tie_embeddings=True,
                                     init_std=0.1))
    trainer = await spawn_service(ServiceConfig(procs_per_host=slots, resource_group="rl"),
                                  TrainerActor, model_dir, lr=0.05, name="trainer",
                                  parallel="fsdp" if slots > 1 else "ddp")
    generator = await spawn_service(ServiceConfig(num_replicas=slots, resource_group="rl"),
                                    GeneratorActor, model_dir, name="generator")
    async with phase(generator):
        before = await generator.generate.fanout(PROMPTS, GREEDY)
    for _ in range(2):  # two full turns on each GPU
        async with phase(trainer):
            usage = await rm.usage()
            for slot, tenants in usage[0].items():
                gen, train = tenants[f"generator_r{slot}"], tenants["trainer_r0"]
                assert gen.resident_bytes == 0 and train.resident_bytes > 0, (slot, tenants)
                assert train.device == gen.device and train.device != "cpu", tenants
            await trainer.train_step.route(logit_loss, torch.tensor([PROMPTS[0], PROMPTS[2]]))
            trained = await trainer.checksum.route()
        await sync_weights(trainer, generator)  # the staged handoff on every GPU
    usage = (await rm.usage())[0]
    devices = {usage[slot]["trainer_r0"].device for slot in usage}
    assert len(devices) == slots, usage  # one GPU per slot, by UUID
    for slot in usage:
        assert usage[slot]["trainer_r0"].resident_bytes == 0, usage[slot]
        assert usage[slot][f"generator_r{slot}"].awake_stages == ("weights",), usage[slot]
    assert await generator.checksum.fanout() == [trained] * slots
    after = await generator.generate.fanout(PROMPTS, GREEDY)
    assert all(out == after[0] for out in after)
    assert [c.tokens for c in after[0]] != [c.tokens for c in before[0]]
